// Package auth owns kvtier's control-plane identities (contract C9): who
// may speak for which rank, engine instance or operator on NATS. It makes
// a cluster's credentials (Init writes one nkey seed per identity, 0600,
// in a 0700 directory, plus a public users file), derives the exact NATS
// permission set of every role (Permissions), turns the users file into
// the embedded server's users (ServerUsers) or an external server's
// configuration (NATSConfig), and gives clients their connect options
// (ClientOptions: nkey signature and a per-identity inbox prefix).
//
// It never grants "subscribe >", never gives one identity another's inbox,
// and never reads a seed file that others can read. It holds no
// connections and starts no goroutines.
package auth
