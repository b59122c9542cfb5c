package auth

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/nats-io/nats.go"
)

// CAFile is the name of the cluster CA certificate in a credentials
// directory (written by InitTLS); clients verify the server against it.
const CAFile = "ca.pem"

// Client says how one process authenticates to NATS.
type Client struct {
	// Identity is who the process is. Required unless Insecure.
	Identity Identity
	// Dir is the credentials directory (Init); the seed is read from
	// Dir/<Identity.Name()>.nk unless SeedFile is set, and Dir/ca.pem, if
	// present, is the TLS CA unless CAFile is set.
	Dir string
	// SeedFile is the identity's seed file. Default "" (from Dir).
	SeedFile string
	// CAFile is a PEM CA bundle that verifies the server's certificate.
	// Default "" (Dir/ca.pem if it exists, else the system roots when the
	// server asks for TLS).
	CAFile string
	// Insecure connects with no credentials: only an --insecure server
	// accepts that. Default false.
	Insecure bool
}

// Validate checks that the client names its credentials.
func (c Client) Validate() error {
	if c.Insecure {
		return nil
	}
	if c.Dir == "" && c.SeedFile == "" {
		return fmt.Errorf("no NATS credentials for %s: give a credentials dir or a seed file (or run insecure): %w", c.Identity, ErrCredsFile)
	}
	return c.Identity.Validate()
}

// Options loads the seed and returns the connect options: nkey, inbox
// prefix and TLS CA. Insecure returns only the CA option (if any).
func (c Client) Options() ([]nats.Option, error) {
	var opts []nats.Option
	ca := c.CAFile
	if ca == "" && c.Dir != "" {
		p := filepath.Join(c.Dir, CAFile)
		if _, err := os.Stat(p); err == nil {
			ca = p
		} else if !errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("CA file %s: %w", p, err)
		}
	}
	if ca != "" {
		opts = append(opts, nats.RootCAs(ca))
	}
	if c.Insecure {
		return opts, nil
	}
	if err := c.Validate(); err != nil {
		return nil, err
	}
	path := c.SeedFile
	if path == "" {
		path = filepath.Join(c.Dir, c.Identity.Name()+SeedSuffix)
	}
	seed, err := LoadSeed(path)
	if err != nil {
		return nil, err
	}
	return append(opts, ClientOptions(c.Identity, seed)...), nil
}
