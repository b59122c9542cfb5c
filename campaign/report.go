package campaign

import (
	"fmt"
	"io"
	"sort"
	"text/tabwriter"
)

// Report is the outcome of a campaign, as JSON and as a printed table.
type Report struct {
	Seed    uint64  `json:"seed"`
	Faults  int     `json:"faults_scheduled"`
	Rate    float64 `json:"rate_per_s"`
	Seconds float64 `json:"seconds"`
	Network string  `json:"network"` // "netns" or "loopback: <why>"
	// Coordinators is 1, or 3 replicated through raft.
	Coordinators int `json:"coordinators"`
	// LeaderHits counts coordinator faults that hit the raft leader;
	// Leaders counts the distinct (term, leader) pairs the samples saw.
	LeaderHits int `json:"raft_leader_faults,omitempty"`
	Leaders    int `json:"raft_leaders_seen,omitempty"`
	// CommitIndex is the leader's raft commit index at the last sample.
	CommitIndex uint64  `json:"raft_commit_index,omitempty"`
	Trace       string  `json:"trace"` // the trace file, or the built-in sample
	L2FS        string  `json:"l2_fs"` // "tmpfs <bytes>" or "directory: <why>"
	Injected    int     `json:"faults_injected"`
	FaultRate   float64 `json:"faults_per_s"`
	// ByKind counts injected and skipped faults per kind.
	ByKind  map[Kind]int    `json:"faults_by_kind"`
	Skipped map[Kind]int    `json:"faults_skipped"`
	SkipWhy map[Kind]string `json:"skip_reasons,omitempty"`
	// NotCovered lists fault kinds of the issue this campaign cannot
	// inject here, and why.
	NotCovered map[string]string `json:"not_covered,omitempty"`
	// Restores counts engine runs by outcome; RestoreRate is runs/s.
	Restores    map[Outcome]int `json:"restores_by_outcome"`
	RestoreRate float64         `json:"restores_per_s"`
	// Recompute counts re-stores of failed or unstored chunks.
	Recomputed      int `json:"recomputed"`
	RecomputeFailed int `json:"recompute_failed"`
	// Final is the engine round after the faults healed (must be complete
	// or explained by an L2 fault).
	Final map[Outcome]int `json:"final_round"`
	// The correctness results.
	WrongComplete        int               `json:"wrong_complete"`
	WrongUnnamed         int               `json:"wrong_unnamed"`
	Wrong                []string          `json:"wrong,omitempty"`
	AckedSeen            int               `json:"acked_placements_seen"`
	LostAcked            int               `json:"lost_acked_placements"`
	Lost                 []Lost            `json:"lost,omitempty"`
	Explained            map[string]int    `json:"acked_placements_by_explanation"`
	VerifyOK             bool              `json:"coordinator_verify_ok"`
	VerifyProblems       []string          `json:"verify_problems,omitempty"`
	IndexEqualsInventory bool              `json:"index_equals_inventory"`
	InventoryDiffs       []string          `json:"inventory_diffs,omitempty"`
	Panics               []string          `json:"panics,omitempty"`
	Crashes              []string          `json:"crashes,omitempty"`
	MaxRSS               map[string]uint64 `json:"max_rss_bytes"`
	RSSBound             uint64            `json:"rss_bound_bytes"`
	RSSOver              []string          `json:"rss_over,omitempty"`
	Proxy                map[string]int64  `json:"proxy_frames"`
	Restarts             map[string]int    `json:"starts"`
	// Refused counts daemon exits with status 1 the campaign did not
	// cause (a refusal to run, logged; not a crash).
	Refused  map[string]int `json:"refused_starts,omitempty"`
	Problems []string       `json:"problems,omitempty"`
	WorkDir  string         `json:"work_dir,omitempty"`
	// OK: zero wrong verdicts, zero lost acknowledged placements, verify
	// clean, index equals inventories, no panic, no crash, memory bounded.
	OK bool `json:"ok"`
}

func (r *Report) judge() {
	r.OK = r.WrongComplete == 0 && r.WrongUnnamed == 0 && r.LostAcked == 0 && r.VerifyOK && r.IndexEqualsInventory &&
		len(r.Panics) == 0 && len(r.Crashes) == 0 && len(r.RSSOver) == 0 && len(r.Problems) == 0
}

// Print writes the report as a table.
func (r *Report) Print(w io.Writer) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "campaign seed %d: %d faults in %.0f s (%.2f/s), network %s, L2 %s, trace %s\n", r.Seed, r.Injected, r.Seconds, r.FaultRate, r.Network, r.L2FS, r.Trace)
	if r.Coordinators > 1 {
		fmt.Fprintf(tw, "coordinators %d (raft): %d coordinator faults hit the leader, %d leaders seen, leader commit index %d at the last sample\n",
			r.Coordinators, r.LeaderHits, r.Leaders, r.CommitIndex)
	}
	fmt.Fprintln(tw, "FAULT\tINJECTED\tSKIPPED")
	for _, k := range Kinds() {
		fmt.Fprintf(tw, "%s\t%d\t%d\t%s\n", k, r.ByKind[k], r.Skipped[k], r.SkipWhy[k])
	}
	fmt.Fprintln(tw, "RESTORE OUTCOME\tRUNS\t")
	outs := make([]string, 0, len(r.Restores))
	for o := range r.Restores {
		outs = append(outs, string(o))
	}
	sort.Strings(outs)
	for _, o := range outs {
		fmt.Fprintf(tw, "%s\t%d\t\n", o, r.Restores[Outcome(o)])
	}
	fmt.Fprintf(tw, "runs/s\t%.2f\t\n", r.RestoreRate)
	fmt.Fprintf(tw, "recomputed (failed)\t%d (%d)\t\n", r.Recomputed, r.RecomputeFailed)
	fmt.Fprintf(tw, "final round\t%v\t\n", r.Final)
	fmt.Fprintln(tw, "CHECK\tRESULT\t")
	fmt.Fprintf(tw, "wrong COMPLETE\t%d\t\n", r.WrongComplete)
	fmt.Fprintf(tw, "wrong unnamed chunk\t%d\t\n", r.WrongUnnamed)
	fmt.Fprintf(tw, "acknowledged placements seen\t%d\t%v\n", r.AckedSeen, r.Explained)
	fmt.Fprintf(tw, "lost acknowledged placements\t%d\t\n", r.LostAcked)
	fmt.Fprintf(tw, "coordinator verify\t%v\t%v\n", r.VerifyOK, r.VerifyProblems)
	fmt.Fprintf(tw, "index equals inventories\t%v\t%v\n", r.IndexEqualsInventory, r.InventoryDiffs)
	fmt.Fprintf(tw, "panics / crashes\t%d / %d\t\n", len(r.Panics), len(r.Crashes))
	fmt.Fprintf(tw, "max RSS (bound %d MiB)\t%v\t\n", r.RSSBound>>20, mib(r.MaxRSS))
	fmt.Fprintf(tw, "proxy frames\t%v\t\n", r.Proxy)
	fmt.Fprintf(tw, "daemon starts (refused)\t%v (%v)\t\n", r.Restarts, r.Refused)
	fmt.Fprintf(tw, "OK\t%v\t%v\n", r.OK, r.Problems)
	tw.Flush()
	nc := make([]string, 0, len(r.NotCovered))
	for k := range r.NotCovered {
		nc = append(nc, k)
	}
	sort.Strings(nc)
	for _, k := range nc {
		fmt.Fprintf(w, "not covered: %s: %s\n", k, r.NotCovered[k])
	}
	for _, s := range r.Wrong {
		fmt.Fprintln(w, "WRONG:", s)
	}
	for _, l := range r.Lost {
		fmt.Fprintf(w, "LOST: %s on %s %s: %s\n", l.Key, l.Holder, l.Tier, l.Why)
	}
	for _, s := range append(r.Panics, r.Crashes...) {
		fmt.Fprintln(w, "PANIC/CRASH:", s)
	}
}

func mib(m map[string]uint64) map[string]string {
	out := map[string]string{}
	for k, v := range m {
		out[k] = fmt.Sprintf("%d MiB", v>>20)
	}
	return out
}
