package admin

import (
	"encoding/json"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/kvtier/kvtier/wire"
)

// Table output of the admin replies, for operators: one header row, one row
// per item, columns aligned. WriteJSON is the machine-readable alternative.

// WriteJSON writes v as indented JSON and a newline.
func WriteJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

type table struct {
	tw *tabwriter.Writer
}

func newTable(w io.Writer, header ...string) *table {
	t := &table{tw: tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)}
	t.row(header...)
	return t
}

func (t *table) row(cols ...string) {
	fmt.Fprintln(t.tw, strings.Join(cols, "\t"))
}

func (t *table) flush() error { return t.tw.Flush() }

func u64(v uint64) string { return strconv.FormatUint(v, 10) }
func i64(v int64) string  { return strconv.FormatInt(v, 10) }

func yes(b bool) string {
	if b {
		return "yes"
	}
	return "-"
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// WriteMembersTable writes the members table.
func WriteMembersTable(w io.Writer, r *wire.AdminMembersReply) error {
	t := newTable(w, "NAME", "ROLE", "STATE", "ADDRESS", "INCARNATION", "RANK", "SINCE")
	for _, m := range r.Members {
		name := m.Name
		if m.Local {
			name += " (self)"
		}
		t.row(name, m.Role, m.State, m.Addr, u64(m.Incarnation), orDash(m.Rank), m.Since.UTC().Format(time.RFC3339))
	}
	if err := t.flush(); err != nil || len(r.Raft) == 0 {
		return err
	}
	if _, err := fmt.Fprintln(w); err != nil {
		return err
	}
	return WriteRaftTable(w, r.Raft)
}

// WriteRaftTable writes one row per coordinator of a replicated cluster:
// its raft role, term, and log, commit and applied indexes (raft's, and
// its index's own).
func WriteRaftTable(w io.Writer, nodes []wire.AdminRaftNode) error {
	t := newTable(w, "RAFT_ID", "ADDRESS", "ROLE", "TERM", "LEADER", "LAST_LOG", "COMMIT", "APPLIED", "INDEX_APPLIED", "SNAPSHOT")
	for _, n := range nodes {
		t.row(n.ID, n.Addr, n.State, u64(n.Term), orDash(n.LeaderID), u64(n.LastLogIndex), u64(n.CommitIndex),
			u64(n.AppliedIndex), u64(n.IndexApplied), u64(n.SnapshotIndex))
	}
	return t.flush()
}

// WriteRanksTable writes the ranks table.
func WriteRanksTable(w io.Writer, r *wire.AdminRanksReply) error {
	t := newTable(w, "RANK", "INCARNATION", "LIVENESS", "L1_OBJECTS", "L1_BYTES", "L2_OBJECTS", "L2_BYTES",
		"L3_OBJECTS", "L3_BYTES", "LAST_SEQ", "FENCED", "RESYNC")
	for _, k := range r.Ranks {
		t.row(k.Rank.String(), u64(k.Incarnation), k.Liveness, i64(k.L1Objects), u64(k.L1Bytes),
			i64(k.L2Objects), u64(k.L2Bytes), i64(k.L3Objects), u64(k.L3Bytes), u64(k.LastSeq), yes(k.Fenced), yes(k.Resync))
	}
	return t.flush()
}

// WriteObjectTable writes an object lookup: one row per placement, and one
// row marked missing for an object without any.
func WriteObjectTable(w io.Writer, r *wire.AdminObjectReply) error {
	if r.Prefix >= 0 {
		if _, err := fmt.Fprintf(w, "restorable prefix: %d chunks (instance %s)\n", r.Prefix, orDash(r.Instance)); err != nil {
			return err
		}
	}
	t := newTable(w, "CHUNK", "KEY", "HOLDER", "TIER", "SIZE", "SUM", "INCARNATION", "SEQ")
	for _, o := range r.Objects {
		chunk := "-"
		if o.Chunk >= 0 {
			chunk = strconv.Itoa(o.Chunk)
		}
		if len(o.Placements) == 0 {
			t.row(chunk, o.Key.String(), "(missing)", "-", "-", "-", "-", "-")
			continue
		}
		for _, p := range o.Placements {
			t.row(chunk, o.Key.String(), p.Holder.String(), p.Tier.String(), u64(p.Size),
				fmt.Sprintf("%016x", p.Sum), u64(p.Incarnation), u64(p.Seq))
		}
	}
	return t.flush()
}

// WriteNamespacesTable writes the namespaces table.
func WriteNamespacesTable(w io.Writer, r *wire.AdminNamespacesReply) error {
	t := newTable(w, "NAMESPACE", "MODEL", "SALT", "TP", "DCP", "GROUPS", "CHUNK_TOKENS", "CHUNKS", "OBJECTS",
		"L1_PLACEMENTS", "L1_BYTES", "L2_PLACEMENTS", "L2_BYTES")
	for _, n := range r.Namespaces {
		model := n.Model
		if !n.Registered {
			model = "(unregistered)"
		}
		t.row(n.Namespace, model, orDash(n.CacheSalt), strconv.Itoa(n.TP), strconv.Itoa(n.DCP),
			strconv.Itoa(n.Groups), strconv.Itoa(n.ChunkTokens), i64(n.Chunks), i64(n.Objects),
			i64(n.L1Placements), u64(n.L1Bytes), i64(n.L2Placements), u64(n.L2Bytes))
	}
	return t.flush()
}

// WriteRestoresTable writes the verdict history, newest first.
func WriteRestoresTable(w io.Writer, r *wire.AdminRestoresReply) error {
	t := newTable(w, "RESTORE", "STATE", "PREFIX", "RANKS", "FAILED", "REASONS", "VERDICT_LATENCY", "DECIDED")
	for _, v := range r.Restores {
		lat := "deadline"
		if v.VerdictLatencyUS >= 0 {
			lat = (time.Duration(v.VerdictLatencyUS) * time.Microsecond).String()
		}
		t.row(v.RestoreID, v.State, strconv.Itoa(v.Prefix), strconv.Itoa(v.Ranks), chunkList(v.Failed),
			orDash(strings.Join(v.Reasons, ";")), lat, v.Decided.UTC().Format(time.RFC3339Nano))
	}
	return t.flush()
}

// chunkList prints a sorted chunk list with runs folded: "0-3,7".
func chunkList(cs []int) string {
	if len(cs) == 0 {
		return "-"
	}
	var b strings.Builder
	for i := 0; i < len(cs); {
		j := i
		for j+1 < len(cs) && cs[j+1] == cs[j]+1 {
			j++
		}
		if b.Len() > 0 {
			b.WriteByte(',')
		}
		b.WriteString(strconv.Itoa(cs[i]))
		if j > i {
			b.WriteByte('-')
			b.WriteString(strconv.Itoa(cs[j]))
		}
		i = j + 1
	}
	return b.String()
}

// WriteVerifyTable writes a verify result.
func WriteVerifyTable(w io.Writer, r *wire.AdminVerifyReply) error {
	status := "OK"
	if !r.OK {
		status = "MISMATCH"
	}
	t := newTable(w, "STATUS", "NAMESPACES", "RANKS", "CHUNKS", "PLACEMENTS", "LOG_RECORDS", "MISMATCHES")
	t.row(status, strconv.Itoa(r.Namespaces), strconv.Itoa(r.Ranks), i64(r.Chunks), i64(r.Placements),
		strconv.Itoa(r.LogRecords), strconv.Itoa(len(r.Mismatches)))
	if err := t.flush(); err != nil {
		return err
	}
	for _, m := range r.Mismatches {
		if _, err := fmt.Fprintln(w, "  "+m); err != nil {
			return err
		}
	}
	return nil
}
