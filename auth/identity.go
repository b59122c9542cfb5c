package auth

import (
	"fmt"
	"strconv"

	"github.com/kvtier/kvtier/wire"
)

// Role is what an identity may do on the bus.
type Role string

// Roles. Each has the permission set Permissions documents.
const (
	// RoleCoordinator subscribes to every rank's events, heartbeats and
	// reports and to the coordinator and admin subjects; it publishes only
	// inventory requests (and replies to what it received).
	RoleCoordinator Role = "coordinator"
	// RoleRankd is one rank <instance>/<tp>: it publishes only its own
	// events, heartbeats and restore reports and subscribes only its own
	// engine API and inventory subjects.
	RoleRankd Role = "rankd"
	// RoleEngine is one engine instance: its rankds' engine API and the
	// coordinator's engine subjects scoped to its instance.
	RoleEngine Role = "engine"
	// RoleAdmin sends read-only admin queries.
	RoleAdmin Role = "admin"
	// RoleAdminWrite sends every admin operation, mutating ones included.
	RoleAdminWrite Role = "admin-write"
)

// Identity is one principal of the cluster. Instance is set for rankd and
// engine, TPRank for rankd. PP, for an engine only, is its pipeline-parallel
// size: an engine of PP > 1 acts for its stage instances
// (wire.StageInstance), whose rankds hold the stages' layers; 0 or 1 means
// none.
type Identity struct {
	Role     Role   `json:"role"`
	Instance string `json:"instance,omitempty"`
	TPRank   int    `json:"tp_rank,omitempty"`
	PP       int    `json:"pp,omitempty"`
}

// MaxPP bounds an engine identity's pipeline-parallel size (dcp.MaxPP).
const MaxPP = 256

// Instances are the instances the identity acts for: an engine's own and,
// under PP > 1, its stage instances; a rankd's own; none otherwise.
func (id Identity) Instances() []string {
	switch id.Role {
	case RoleRankd:
		return []string{id.Instance}
	case RoleEngine:
		out := []string{id.Instance}
		for s := 0; id.PP > 1 && s < id.PP; s++ {
			out = append(out, wire.StageInstance(id.Instance, id.PP, s))
		}
		return out
	}
	return nil
}

// Rankd returns the identity of rank r.
func Rankd(r wire.Rank) Identity {
	return Identity{Role: RoleRankd, Instance: r.Instance, TPRank: r.TPRank}
}

// Engine returns the identity of engine instance inst.
func Engine(inst string) Identity { return Identity{Role: RoleEngine, Instance: inst} }

// MaxTPRank bounds the TP rank of a rankd identity.
const MaxTPRank = 1 << 16

// Validate checks the identity's role and the fields it needs.
func (id Identity) Validate() error {
	switch id.Role {
	case RoleCoordinator, RoleAdmin, RoleAdminWrite:
		if id.Instance != "" || id.TPRank != 0 || id.PP != 0 {
			return fmt.Errorf("role %s takes no instance or TP rank (got %q, %d): %w", id.Role, id.Instance, id.TPRank, ErrIdentity)
		}
	case RoleEngine:
		if err := wire.ValidInstance(id.Instance); err != nil {
			return fmt.Errorf("engine identity: %w: %w", ErrIdentity, err)
		}
		if id.TPRank != 0 {
			return fmt.Errorf("engine identity %s takes no TP rank (got %d): %w", id.Instance, id.TPRank, ErrIdentity)
		}
		if id.PP < 0 || id.PP > MaxPP {
			return fmt.Errorf("engine identity %s: PP size %d outside [0, %d]: %w", id.Instance, id.PP, MaxPP, ErrIdentity)
		}
		for _, inst := range id.Instances()[1:] {
			if err := wire.ValidInstance(inst); err != nil {
				return fmt.Errorf("engine identity %s: stage instance: %w: %w", id.Instance, ErrIdentity, err)
			}
		}
	case RoleRankd:
		if err := wire.ValidInstance(id.Instance); err != nil {
			return fmt.Errorf("rankd identity: %w: %w", ErrIdentity, err)
		}
		if id.PP != 0 {
			return fmt.Errorf("rankd identity %s takes no PP size (its instance is its stage's): %w", id.Instance, ErrIdentity)
		}
		if id.TPRank < 0 || id.TPRank >= MaxTPRank {
			return fmt.Errorf("rankd identity %s: TP rank %d outside [0, %d): %w", id.Instance, id.TPRank, MaxTPRank, ErrIdentity)
		}
	default:
		return fmt.Errorf("role %q is not one of coordinator, rankd, engine, admin, admin-write: %w", id.Role, ErrIdentity)
	}
	return nil
}

// Name is the identity's file and inbox name: "coordinator", "admin",
// "admin-write", "engine-<instance>", "rankd-<instance>-<tp>". It is one
// NATS subject token.
func (id Identity) Name() string {
	switch id.Role {
	case RoleEngine:
		return "engine-" + id.Instance
	case RoleRankd:
		return "rankd-" + id.Instance + "-" + strconv.Itoa(id.TPRank)
	}
	return string(id.Role)
}

// String is the identity for logs: role and scope.
func (id Identity) String() string {
	switch id.Role {
	case RoleEngine:
		return "engine " + id.Instance
	case RoleRankd:
		return "rankd " + id.Instance + "/" + strconv.Itoa(id.TPRank)
	}
	return string(id.Role)
}

// InboxPrefix is the inbox prefix of the identity's connections: replies
// to its requests arrive under it, and only it may subscribe there.
func (id Identity) InboxPrefix() string { return "_INBOX." + id.Name() }
