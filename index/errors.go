package index

import "errors"

// Sentinel errors. Every error this package returns wraps one of them with
// context (the rank, the namespace, the numbers), so callers use errors.Is.
var (
	// ErrConfig: a Config field breaks a rule.
	ErrConfig = errors.New("invalid index config")
	// ErrClosed: the Index has been closed.
	ErrClosed = errors.New("index closed")
	// ErrFailed: an earlier bbolt commit failed; the index refuses writes
	// until it is closed and reopened (a failed fsync leaves the file's
	// state unknown, so retrying on the same handle could acknowledge
	// writes that are not durable).
	ErrFailed = errors.New("index failed: reopen it")
	// ErrStore: bbolt returned an error (open, commit, read).
	ErrStore = errors.New("index store error")
	// ErrCorrupt: bytes in the store do not decode.
	ErrCorrupt = errors.New("index store corrupt")
	// ErrInvalid: a batch, inventory or spec breaks a rule; nothing of it
	// was applied.
	ErrInvalid = errors.New("invalid index input")
	// ErrZeroSum: a batch stores, or an inventory lists, an object with
	// sum 0 (issue 11.8: 0 is what an unset sum looks like, and a restore
	// could never check the bytes against it); nothing of the batch or
	// inventory was applied. It is one of the rules of ErrInvalid:
	// errors.Is matches both. Placements with sum 0 written before the rule
	// existed are still read (the restore plan cuts its prefix before
	// them).
	ErrZeroSum error = invalidRule("every stored object has a nonzero kvsum64")
	// ErrUnknownNamespace: a lookup named a namespace whose spec was never
	// registered.
	ErrUnknownNamespace = errors.New("unknown namespace")
	// ErrUnknownRank: a query named a rank the index has never heard from.
	ErrUnknownRank = errors.New("unknown rank")
	// ErrNamespaceConflict: a namespace was registered again with a spec
	// whose restore expectations differ from the registered one.
	ErrNamespaceConflict = errors.New("namespace registered with another spec")
	// ErrInconsistent: Verify found the live state and the store disagree,
	// or an invariant broken.
	ErrInconsistent = errors.New("index inconsistent")

	// ErrRestore: NewRestore was given an invalid expectation set.
	ErrRestore = errors.New("invalid restore")
	// ErrUnexpectedReport: a restore report came from a rank, or named a
	// chunk or group, that the restore does not expect.
	ErrUnexpectedReport = errors.New("unexpected restore report")
)

// invalidRule is a sentinel for one rule of ErrInvalid: its text is the
// rule alone (callers add their own context after it, as the coordinator
// adds wire.ErrMalformed), and errors.Is matches ErrInvalid too.
type invalidRule string

func (e invalidRule) Error() string { return string(e) }

// Is reports whether target is ErrInvalid (errors.Is compares e itself).
func (invalidRule) Is(target error) bool { return target == ErrInvalid }
