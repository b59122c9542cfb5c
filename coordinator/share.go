package coordinator

import (
	"fmt"
	"slices"
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvtier/kvtier/auth"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/wire"
)

// Share groups (issue 26, docs/sharing.md). A lookup or restore.begin of
// an engine of instance B reads, besides B's own copies, the L2 copies
// (with Config.ShareL3, also the L3 copies; with Config.ShareHostL1, the
// host-shared L1 copies) of the other instances of B's share group (index.LookupSharedInto): B's
// ranks stay the readers, each confirming the sum recorded when the
// holder stored the object (C5). What a caller may ask does not change:
// an engine acts only for the instance of its subject (scope), so a
// request naming another instance is refused whether or not that instance
// shares; one naming an instance of a group the caller is not in is also
// counted in kvtier_coord_share_refused_total. An engine outside a group
// gets a plain miss for the group's prompts: never a refusal, which would
// tell it that another tenant holds them.

// ShareGroup is one share group: a name (for logs, metrics and operators)
// and its member instances.
type ShareGroup struct {
	Name      string
	Instances []string
}

// MaxShareGroupMembers bounds a group's instances (the index's
// index.MaxShared others, plus the reader).
const MaxShareGroupMembers = index.MaxShared + 1

// ParseShareGroup parses the --share-group flag's form,
// NAME=INSTANCE,INSTANCE[,...], and checks it like Validate.
func ParseShareGroup(s string) (ShareGroup, error) {
	name, list, ok := strings.Cut(s, "=")
	if !ok {
		return ShareGroup{}, fmt.Errorf("share group %q: want NAME=INSTANCE,INSTANCE[,...]: %w", s, ErrConfig)
	}
	g := ShareGroup{Name: name}
	for _, inst := range strings.Split(list, ",") {
		g.Instances = append(g.Instances, strings.TrimSpace(inst))
	}
	if err := validateShareGroups([]ShareGroup{g}); err != nil {
		return ShareGroup{}, err
	}
	return g, nil
}

// validateShareGroups checks the groups: valid names (as instance names),
// unique; each of 2..MaxShareGroupMembers valid instances, none twice,
// and no instance in two groups.
func validateShareGroups(gs []ShareGroup) error {
	names := make(map[string]bool, len(gs))
	groupOf := make(map[string]string)
	for _, g := range gs {
		if err := wire.ValidInstance(g.Name); err != nil {
			return fmt.Errorf("share group name: %w: %w", err, ErrConfig)
		}
		if names[g.Name] {
			return fmt.Errorf("share group %q is configured twice: %w", g.Name, ErrConfig)
		}
		names[g.Name] = true
		if n := len(g.Instances); n < 2 || n > MaxShareGroupMembers {
			return fmt.Errorf("share group %q has %d instances, want 2..%d: %w", g.Name, n, MaxShareGroupMembers, ErrConfig)
		}
		for _, inst := range g.Instances {
			if err := wire.ValidInstance(inst); err != nil {
				return fmt.Errorf("share group %q: %w: %w", g.Name, err, ErrConfig)
			}
			switch other, dup := groupOf[inst]; {
			case dup && other == g.Name:
				return fmt.Errorf("share group %q names instance %q twice: %w", g.Name, inst, ErrConfig)
			case dup:
				return fmt.Errorf("instance %q is in share groups %q and %q; an instance shares with one group: %w",
					inst, other, g.Name, ErrConfig)
			}
			groupOf[inst] = g.Name
		}
	}
	return nil
}

// shareGroupsFitUsers checks the share groups against the engines of the
// users file: a pipeline stage holds only its own layers, so its copies
// are of its own namespace (the stage is in the fingerprint) and a group
// shares stage by stage. A group that names a pipeline-parallel engine's
// own instance, or mixes stages or PP sizes, would never match; it is
// refused with what to write instead. Instances no engine acts for yet
// are left alone (as without users).
func shareGroupsFitUsers(gs []ShareGroup, u *auth.Users) error {
	for _, g := range gs {
		type stageOf struct{ pp, stage int }
		var first *stageOf
		var firstInst string
		for _, inst := range g.Instances {
			eng, pp, stage, ok := u.Stage(inst)
			if !ok {
				continue
			}
			if pp > 1 && inst == eng {
				return fmt.Errorf("share group %q names instance %q, an engine of %d pipeline stages: each stage holds its own layers and shares them only with the same stage of the other engines; list the stage instances, one share group per stage (for example --share-group %s-pp0=%s,...): %w",
					g.Name, inst, pp, g.Name, wire.StageInstance(inst, pp, 0), ErrConfig)
			}
			this := stageOf{pp, stage}
			if first == nil {
				first, firstInst = &this, inst
				continue
			}
			if *first != this {
				return fmt.Errorf("share group %q mixes %q (PP %d, stage %d) and %q (PP %d, stage %d): their copies never match (the stage and the PP size are in the namespace); one share group per stage: %w",
					g.Name, firstInst, first.pp, first.stage, inst, pp, stage, ErrConfig)
			}
		}
	}
	return nil
}

// shareState is what the coordinator derives from Config.ShareGroups in
// New; read-only afterwards (no lock).
type shareState struct {
	// groupOf is each member's group; others each member's group's other
	// instances, sorted (index.LookupSharedInto's shared).
	groupOf map[string]string
	others  map[string][]string
	// groups are the members of each group, as configured.
	groups map[string][]string
	// load is each member's recent engine lookups (routeload.go); the
	// map is read-only, each memberLoad has its own lock.
	load map[string]*memberLoad

	met *shareMetrics
}

func newShareState(gs []ShareGroup) *shareState {
	s := &shareState{groupOf: make(map[string]string), others: make(map[string][]string), groups: make(map[string][]string),
		load: make(map[string]*memberLoad), met: newShareMetrics()}
	for _, g := range gs {
		s.groups[g.Name] = g.Instances
		for _, inst := range g.Instances {
			s.groupOf[inst] = g.Name
			s.load[inst] = &memberLoad{}
			var o []string
			for _, x := range g.Instances {
				if x != inst {
					o = append(o, x)
				}
			}
			slices.Sort(o)
			s.others[inst] = o
		}
	}
	return s
}

// shared returns the other instances of instance's share group (nil when
// it is in none).
func (s *shareState) shared(instance string) []string { return s.others[instance] }

// outside reports whether named is a member of a share group that caller
// is not in (the named instance's copies are not caller's to read), and
// that group's name.
func (s *shareState) outside(caller, named string) (string, bool) {
	g, ok := s.groupOf[named]
	if !ok || s.groupOf[caller] == g {
		return "", false
	}
	return g, true
}

// shareMetrics are the share groups' counters.
type shareMetrics struct {
	lookups  prometheus.Counter     // engine lookups whose prefix reads another member's copy
	restores prometheus.Counter     // restores planned reading another member's copy
	objects  prometheus.Counter     // objects planned from another member's copy
	refused  *prometheus.CounterVec // by op
}

// shareRefusedOps are the op labels of kvtier_coord_share_refused_total.
var shareRefusedOps = []string{"lookup", "restore_begin", "restore_wait", "restore_cancel"}

func newShareMetrics() *shareMetrics {
	m := &shareMetrics{
		lookups: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvtier_coord_share_lookups_total",
			Help: "Engine lookups whose prefix reads at least one L2 (or, with --share-l3, L3) copy stored by another instance of the caller's share group.",
		}),
		restores: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvtier_coord_share_restores_total",
			Help: "Restores planned with at least one object read from the L2 (or, with --share-l3, L3) copy of another instance of the reader's share group.",
		}),
		objects: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvtier_coord_share_planned_objects_total",
			Help: "Objects of restore plans read from the L2 (or, with --share-l3, L3) copy of another instance of the reader's share group.",
		}),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvtier_coord_share_refused_total",
			Help: "Engine requests refused because they name an instance of a share group the caller is not in (also counted in kvtier_coord_unauthorized_total), by operation.",
		}, []string{"op"}),
	}
	initLabels(m.refused, shareRefusedOps...)
	return m
}

func (m *shareMetrics) Describe(ch chan<- *prometheus.Desc) {
	m.lookups.Describe(ch)
	m.restores.Describe(ch)
	m.objects.Describe(ch)
	m.refused.Describe(ch)
}

func (m *shareMetrics) Collect(ch chan<- prometheus.Metric) {
	m.lookups.Collect(ch)
	m.restores.Collect(ch)
	m.objects.Collect(ch)
	m.refused.Collect(ch)
}
