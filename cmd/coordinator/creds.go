package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/kvtier/kvtier/auth"
	"github.com/kvtier/kvtier/cluster"
	"github.com/kvtier/kvtier/wire"
)

// instancesFlag collects repeated --instance NAME with the --tp-size that
// follows each (or precedes the next instance).
type instancesFlag struct{ list []auth.Instance }

func (f *instancesFlag) String() string { return fmt.Sprint(f.list) }
func (f *instancesFlag) Set(s string) error {
	f.list = append(f.list, auth.Instance{Name: s, TPSize: 1})
	return nil
}

// sizeFlag sets one size (--tp-size, --pp-size) of the preceding --instance.
type sizeFlag struct {
	f    *instancesFlag
	name string
	set  func(in *auth.Instance, n int)
}

func tpFlag(f *instancesFlag) sizeFlag {
	return sizeFlag{f, "tp-size", func(in *auth.Instance, n int) { in.TPSize = n }}
}

func ppFlag(f *instancesFlag) sizeFlag {
	return sizeFlag{f, "pp-size", func(in *auth.Instance, n int) { in.PPSize = n }}
}

func (t sizeFlag) String() string { return "" }
func (t sizeFlag) Set(s string) error {
	if len(t.f.list) == 0 {
		return fmt.Errorf("--%s must follow an --instance", t.name)
	}
	var n int
	if _, err := fmt.Sscan(s, &n); err != nil {
		return fmt.Errorf("--%s %q: %w", t.name, s, err)
	}
	t.set(&t.f.list[len(t.f.list)-1], n)
	return nil
}

// initCreds is 'coordinator init'.
func initCreds(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("init", flag.ContinueOnError)
	fs.SetOutput(stderr)
	dir := fs.String("dir", "", "credentials directory to create (must be empty or absent; made 0700)")
	var inst instancesFlag
	fs.Var(&inst, "instance", "engine instance to make an engine and rankd identities for (repeatable)")
	fs.Var(tpFlag(&inst), "tp-size", "TP size of the preceding --instance (default 1)")
	fs.Var(ppFlag(&inst), "pp-size", "pipeline-parallel size of the preceding --instance (default 1): its rankds are instances <instance>-pp<stage>, its engine identity acts for every stage")
	tlsHosts := fs.String("tls-host", "", "also write a CA and a server certificate for these IPs/names, comma-separated (needed when NATS listens off loopback)")
	raftIDs := fs.String("raft-ids", "", "also issue a raft peer certificate for each of these raft server ids, comma-separated (replicated coordinators; needs --tls-host: the cluster CA signs them)")
	natsConf := fs.String("nats-conf", "", "also write an external nats-server configuration with every user's permissions to this file")
	prefix := fs.String("prefix", wire.DefaultPrefix, "NATS subject prefix (for --nats-conf)")
	if err := fs.Parse(args); err != nil {
		return exitUsage
	}
	if *dir == "" || fs.NArg() > 0 {
		fmt.Fprintln(stderr, "init: --dir is required; no positional arguments")
		return exitUsage
	}
	ids := splitList(*raftIDs)
	if len(ids) > 0 && *tlsHosts == "" {
		fmt.Fprintln(stderr, "init: --raft-ids needs --tls-host: the cluster CA it makes signs the raft certificates (NATS then speaks TLS too; give 127.0.0.1 on one machine)")
		return exitUsage
	}
	for _, id := range ids {
		if err := auth.ValidRaftFileID(id); err != nil {
			fmt.Fprintf(stderr, "init: --raft-ids: %v\n", err)
			return exitUsage
		}
	}
	if err := auth.Init(*dir, inst.list); err != nil {
		fmt.Fprintf(stderr, "init: %v\n", err)
		return exitFail
	}
	if *tlsHosts != "" {
		if err := auth.InitTLS(*dir, splitList(*tlsHosts)); err != nil {
			fmt.Fprintf(stderr, "init: %v\n", err)
			return exitFail
		}
	}
	for _, id := range ids {
		if err := auth.IssueRaftCert(*dir, id, false); err != nil {
			fmt.Fprintf(stderr, "init: %v\n", err)
			return exitFail
		}
	}
	if *natsConf != "" {
		if err := writeNATSConf(*dir, *natsConf, *prefix); err != nil {
			fmt.Fprintf(stderr, "init: %v\n", err)
			return exitFail
		}
	}
	fmt.Fprintf(stdout, "credentials written to %s: give each daemon its own <identity>.nk only; users.json is public\n", *dir)
	return exitOK
}

// creds is 'coordinator creds add|rotate|nats-conf|route-secret|storage-key|tls|raft-cert'.
func creds(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprintln(stderr, "usage: coordinator creds add|rotate|nats-conf|route-secret|storage-key|tls|raft-cert --dir D ...")
		return exitUsage
	}
	sub, args := args[0], args[1:]
	fs := flag.NewFlagSet("creds "+sub, flag.ContinueOnError)
	fs.SetOutput(stderr)
	dir := fs.String("dir", "", "credentials directory (required)")
	var inst instancesFlag
	var name, out, prefix, hosts *string
	var ids listFlag
	var replace *bool
	switch sub {
	case "add":
		fs.Var(&inst, "instance", "engine instance to add identities for (repeatable)")
		fs.Var(tpFlag(&inst), "tp-size", "TP size of the preceding --instance")
		fs.Var(ppFlag(&inst), "pp-size", "pipeline-parallel size of the preceding --instance (default 1)")
	case "rotate":
		name = fs.String("name", "", "identity to give a new key, e.g. rankd-engine0-3")
	case "nats-conf":
		out = fs.String("out", "", "nats-server configuration file to write")
		prefix = fs.String("prefix", wire.DefaultPrefix, "NATS subject prefix")
	case "route-secret":
		// For a directory made before 'coordinator init' wrote one; copy
		// the directory to every coordinator of the NATS cluster after.
	case "storage-key":
		// For a directory made before 'coordinator init' wrote one (issue
		// 28.1): only storage.key is written; give it to every rankd.
	case "tls":
		// For a directory made without --tls-host: the cluster CA (which
		// raft certificates need) and the NATS server certificate.
		hosts = fs.String("host", "", "IPs/names of the NATS server certificate, comma-separated (required)")
	case "raft-cert":
		fs.Var(&ids, "id", "raft server id to issue a certificate for (repeatable, or comma-separated)")
		replace = fs.Bool("replace", false, "replace an existing certificate and key (renewal; restart that coordinator after)")
	default:
		fmt.Fprintf(stderr, "creds: unknown subcommand %q (add, rotate, nats-conf, route-secret, storage-key, tls, raft-cert)\n", sub)
		return exitUsage
	}
	if err := fs.Parse(args); err != nil {
		return exitUsage
	}
	if *dir == "" || fs.NArg() > 0 {
		fmt.Fprintf(stderr, "creds %s: --dir is required; no positional arguments\n", sub)
		return exitUsage
	}
	var err error
	switch sub {
	case "add":
		if len(inst.list) == 0 {
			fmt.Fprintln(stderr, "creds add: give --instance NAME --tp-size N")
			return exitUsage
		}
		for _, in := range inst.list {
			if err = auth.AddInstance(*dir, in); err != nil {
				break
			}
		}
	case "rotate":
		err = auth.Rotate(*dir, *name)
	case "nats-conf":
		err = writeNATSConf(*dir, *out, *prefix)
	case "route-secret":
		err = auth.InitRouteSecret(*dir)
	case "storage-key":
		err = auth.InitStorageKey(*dir)
	case "tls":
		if len(splitList(*hosts)) == 0 {
			fmt.Fprintln(stderr, "creds tls: give --host IP,...")
			return exitUsage
		}
		err = auth.InitTLS(*dir, splitList(*hosts))
	case "raft-cert":
		if len(ids) == 0 {
			fmt.Fprintln(stderr, "creds raft-cert: give --id ID (one per raft server)")
			return exitUsage
		}
		for _, id := range ids {
			if err = auth.IssueRaftCert(*dir, id, *replace); err != nil {
				break
			}
			fmt.Fprintf(stdout, "raft certificate for %s: %s, %s (give them and ca.pem to that coordinator only)\n", id,
				filepath.Join(*dir, auth.RaftCertFile(id)), filepath.Join(*dir, auth.RaftCertKeyFile(id)))
		}
	}
	if err != nil {
		fmt.Fprintf(stderr, "creds %s: %v\n", sub, err)
		return exitFail
	}
	fmt.Fprintf(stdout, "credentials in %s updated; send SIGHUP to the coordinator (or restart it) to load them\n", *dir)
	return exitOK
}

func writeNATSConf(dir, out, prefix string) error {
	if out == "" {
		return errors.New("no output file for the NATS configuration")
	}
	u, err := auth.LoadUsers(filepath.Join(dir, auth.UsersFile))
	if err != nil {
		return err
	}
	return os.WriteFile(out, []byte(auth.NATSConfig(u, prefix)), 0o644)
}

// listFlag collects a repeatable flag whose values may also be
// comma-separated.
type listFlag []string

func (f *listFlag) String() string { return strings.Join(*f, ",") }
func (f *listFlag) Set(s string) error {
	*f = append(*f, splitList(s)...)
	return nil
}

func splitList(s string) []string {
	var out []string
	for _, x := range strings.Split(s, ",") {
		if x = strings.TrimSpace(x); x != "" {
			out = append(out, x)
		}
	}
	return out
}

// gossipKeys fills cc's keys from file, or from <credsDir>/gossip.key when
// file is empty and that exists (and no key was given on the command line).
func gossipKeys(cc *cluster.Config, file, credsDir string, haveKey bool) error {
	if file == "" && !haveKey && credsDir != "" {
		p := filepath.Join(credsDir, auth.GossipKeyFile)
		if _, err := os.Stat(p); err == nil {
			file = p
		} else if !errors.Is(err, fs.ErrNotExist) {
			return err
		}
	}
	if file == "" {
		return nil
	}
	if haveKey {
		return errors.New("give --gossip-key or --gossip-key-file, not both")
	}
	k, more, err := auth.LoadGossipKeys(file)
	if err != nil {
		return err
	}
	cc.SecretKey, cc.SecondaryKeys = k, more
	return nil
}
