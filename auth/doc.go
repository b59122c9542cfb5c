// Package auth owns kvtier's control-plane identities (contract C9): who
// may speak for which rank, engine instance or operator on NATS. It makes
// a cluster's credentials (Init writes one nkey seed per identity, 0600,
// in a 0700 directory, plus a public users file), derives the exact NATS
// permission set of every role (Permissions), turns the users file into
// the embedded server's users (ServerUsers) or an external server's
// configuration (NATSConfig), gives clients their connect options
// (ClientOptions: nkey signature and a per-identity inbox prefix), and
// gives the embedded servers of several coordinators the credentials and
// TLS of the routes between them (RouteCredentials, RouteTLS), and issues
// and checks the raft peer certificates of replicated coordinators
// (IssueRaftCert, LoadRaftTLS, VerifyRaftPeer: the cluster CA's
// certificates naming kvtier://raft/<server id>).
//
// It never grants "subscribe >", never gives one identity another's inbox,
// and never reads a seed or route secret file that others can read. It holds no
// connections and starts no goroutines.
package auth
