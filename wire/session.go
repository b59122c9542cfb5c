package wire

import "fmt"

// Engine sessions (rankd engine API).
//
// A successful engine.register answers a session id: 128 random bits as 32
// lowercase hex characters (RegisterReply.Session). Every later store,
// retrieve and release of that engine process names it in its "session"
// field. A rankd serves a request only against the pools its own session
// imported; a request naming a session this rankd never issued (or has
// forgotten) is refused with CodeUnknownSession, one naming a session that
// was superseded by a newer registration of the namespace or released is
// refused with CodeStaleSession, one from another engine identity than the
// session's owner with CodeUnauthorized. No request is ever served against
// another session's pools.
const (
	CodeUnknownSession = "unknown_session" // the rankd never issued this session id (or the request has none)
	CodeStaleSession   = "stale_session"   // the session was superseded by a newer registration, or released
)

// SessionIDBytes is the size of a session id; its text form is twice as
// long (hex).
const SessionIDBytes = 16

// CheckSessionID reports whether s is the text form of a session id: 32
// lowercase hex characters.
func CheckSessionID(s string) error {
	if len(s) != 2*SessionIDBytes {
		return fmt.Errorf("session id of %d characters, want %d hex characters: %w", len(s), 2*SessionIDBytes, ErrMalformed)
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return fmt.Errorf("session id character %d is %q, want lowercase hex: %w", i, c, ErrMalformed)
		}
	}
	return nil
}
