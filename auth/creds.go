package auth

import (
	"bytes"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"syscall"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"

	"github.com/kvtier/kvtier/internal/durable"
	"github.com/kvtier/kvtier/wire"
)

// File names inside a credentials directory.
const (
	// UsersFile is the public users file: every identity's role, scope and
	// nkey public key. It holds no secret (mode 0644).
	UsersFile = "users.json"
	// GossipKeyFile holds the memberlist key, base64 of 32 random bytes
	// (mode 0600).
	GossipKeyFile = "gossip.key"
	// SeedSuffix ends every seed file: <Identity.Name()>.nk, mode 0600.
	SeedSuffix = ".nk"
	// StorageKeyFile holds the storage MAC key, base64 of 32 random bytes
	// (mode 0600): every rankd of the cluster MACs the headers of the L2
	// and L3 objects it writes with it, and announces after a restart only
	// the objects whose MAC verifies (C12). It must never be stored beside
	// the objects (in an L2 directory or the bucket).
	StorageKeyFile = "storage.key"
)

// User is one entry of the users file.
type User struct {
	Name string `json:"name"`
	Identity
	// NKey is the user's public nkey ("U...").
	NKey string `json:"nkey"`
}

// Users is the users file.
type Users struct {
	Version int    `json:"version"`
	Users   []User `json:"users"`
}

// UsersVersion is the users file format version.
const UsersVersion = 1

// Instance is one engine instance Init makes credentials for: an engine
// identity and TPSize rankd identities, or, under PPSize > 1, TPSize rankd
// identities of each stage instance (wire.StageInstance) and an engine
// identity that acts for every stage.
type Instance struct {
	Name   string
	TPSize int
	PPSize int // 0 or 1: no pipeline stages
}

// Init makes the credentials of a new cluster in dir (created 0700; it
// must be empty or absent): the coordinator, admin and admin-write
// identities, one engine and TPSize rankd identities per instance, a
// gossip key, a route secret (RouteSecretFile), a storage MAC key
// (StorageKeyFile), and the users file. It refuses to overwrite anything.
func Init(dir string, instances []Instance) error {
	if err := durable.MkdirAll(dir, 0o700); err != nil { // its name survives a power cut
		return fmt.Errorf("create credentials dir %s: %w", dir, err)
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return fmt.Errorf("credentials dir %s: %w", dir, err)
	}
	if ents, err := os.ReadDir(dir); err != nil {
		return fmt.Errorf("read credentials dir %s: %w", dir, err)
	} else if len(ents) > 0 {
		return fmt.Errorf("credentials dir %s holds %d entries; Init writes only into an empty one (use Add): %w", dir, len(ents), ErrExists)
	}
	ids := []Identity{{Role: RoleCoordinator}, {Role: RoleAdmin}, {Role: RoleAdminWrite}}
	for _, in := range instances {
		more, err := instanceIdentities(in)
		if err != nil {
			return err
		}
		ids = append(ids, more...)
	}
	if err := instancesDisjoint(ids); err != nil { // before anything is written
		return err
	}
	key := make([]byte, 32)
	if _, err := rand.Read(key); err != nil {
		return fmt.Errorf("gossip key: %w", err)
	}
	if err := writeNew(filepath.Join(dir, GossipKeyFile), []byte(base64.StdEncoding.EncodeToString(key)+"\n"), 0o600); err != nil {
		return err
	}
	if err := InitRouteSecret(dir); err != nil {
		return err
	}
	if err := InitStorageKey(dir); err != nil {
		return err
	}
	return Add(dir, ids...)
}

func instanceIdentities(in Instance) ([]Identity, error) {
	if in.TPSize < 1 || in.TPSize > MaxTPRank {
		return nil, fmt.Errorf("instance %s: TP size %d outside [1, %d]: %w", in.Name, in.TPSize, MaxTPRank, ErrIdentity)
	}
	if in.PPSize < 0 || in.PPSize > MaxPP {
		return nil, fmt.Errorf("instance %s: PP size %d outside [1, %d]: %w", in.Name, in.PPSize, MaxPP, ErrIdentity)
	}
	eng := Engine(in.Name)
	if in.PPSize > 1 {
		eng.PP = in.PPSize
	}
	ids := []Identity{eng}
	for s := 0; s < max(in.PPSize, 1); s++ {
		for t := range in.TPSize {
			ids = append(ids, Identity{Role: RoleRankd, Instance: wire.StageInstance(in.Name, in.PPSize, s), TPRank: t})
		}
	}
	for _, id := range ids {
		if err := id.Validate(); err != nil {
			return nil, err
		}
	}
	return ids, nil
}

// AddInstance adds the engine and rankd identities of one instance to an
// existing credentials directory; identities already there are kept.
func AddInstance(dir string, in Instance) error {
	ids, err := instanceIdentities(in)
	if err != nil {
		return err
	}
	u, err := LoadUsers(filepath.Join(dir, UsersFile))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	have := map[string]Identity{}
	if u != nil {
		for _, x := range u.Users {
			have[x.Name] = x.Identity
		}
	}
	var add []Identity
	for _, id := range ids {
		old, ok := have[id.Name()]
		if !ok {
			add = append(add, id)
			continue
		}
		if old != id {
			// An engine identity kept with another PP size would not
			// reach the new stages' rankds (or would still reach old ones).
			return fmt.Errorf("instance %s: identity %s exists as %+v, want %+v; not changed: %w", in.Name, id.Name(), old, id, ErrExists)
		}
	}
	return Add(dir, add...)
}

// Add writes a new seed for each identity and adds it to the users file
// (creating it). An identity already in the users file is refused with
// ErrExists: rotate with Rotate.
func Add(dir string, ids ...Identity) error {
	path := filepath.Join(dir, UsersFile)
	u, err := LoadUsers(path)
	if errors.Is(err, fs.ErrNotExist) {
		u, err = &Users{Version: UsersVersion}, nil
	}
	if err != nil {
		return err
	}
	seen := map[string]bool{}
	for _, id := range ids {
		if err := id.Validate(); err != nil {
			return err
		}
		if u.find(id.Name()) >= 0 || seen[id.Name()] {
			return fmt.Errorf("identity %s is already in %s (rotate it instead): %w", id.Name(), path, ErrExists)
		}
		seen[id.Name()] = true
	}
	all := make([]Identity, 0, len(u.Users)+len(ids))
	for _, x := range u.Users {
		all = append(all, x.Identity)
	}
	if err := instancesDisjoint(append(all, ids...)); err != nil {
		return err
	}
	for _, id := range ids {
		pub, err := newSeed(dir, id, false)
		if err != nil {
			return err
		}
		u.Users = append(u.Users, User{Name: id.Name(), Identity: id, NKey: pub})
	}
	return u.write(path)
}

// instancesDisjoint checks that no two engine identities act for the same
// instance: a pipeline-parallel engine acts for its stage instances
// (Identity.Instances), so an engine "a" of PP 2 and another tenant's
// engine named "a-pp1" would both reach a-pp1's rankds and coordinator
// subjects.
func instancesDisjoint(ids []Identity) error {
	owner := map[string]string{}
	for _, id := range ids {
		if id.Role != RoleEngine {
			continue
		}
		for _, inst := range id.Instances() {
			if o, taken := owner[inst]; taken && o != id.Name() {
				return fmt.Errorf("engine identities %s and %s would both act for instance %s (a pipeline stage is <instance>-pp<stage>): %w",
					o, id.Name(), inst, ErrIdentity)
			}
			owner[inst] = id.Name()
		}
	}
	return nil
}

// Rotate replaces the seed of an identity in the users file with a new
// one. The running coordinator accepts the new key once it reloads the
// users file (SIGHUP or restart); until then only the old seed works.
func Rotate(dir string, name string) error {
	path := filepath.Join(dir, UsersFile)
	u, err := LoadUsers(path)
	if err != nil {
		return err
	}
	i := u.find(name)
	if i < 0 {
		return fmt.Errorf("identity %s is not in %s: %w", name, path, ErrIdentity)
	}
	pub, err := newSeed(dir, u.Users[i].Identity, true)
	if err != nil {
		return err
	}
	u.Users[i].NKey = pub
	return u.write(path)
}

func (u *Users) find(name string) int {
	for i, x := range u.Users {
		if x.Name == name {
			return i
		}
	}
	return -1
}

// newSeed makes a user nkey and writes its seed to <dir>/<name>.nk (0600,
// via a temp file and rename when replace is set).
func newSeed(dir string, id Identity, replace bool) (string, error) {
	kp, err := nkeys.CreateUser()
	if err != nil {
		return "", fmt.Errorf("create nkey for %s: %w", id.Name(), err)
	}
	seed, err := kp.Seed()
	if err != nil {
		return "", err
	}
	pub, err := kp.PublicKey()
	if err != nil {
		return "", err
	}
	path := filepath.Join(dir, id.Name()+SeedSuffix)
	data := append(seed, '\n')
	if !replace {
		return pub, writeNew(path, data, 0o600)
	}
	tmp := path + ".tmp"
	_ = os.Remove(tmp)
	if err := writeNew(tmp, data, 0o600); err != nil {
		return "", err
	}
	if err := replaceFile(tmp, path); err != nil {
		return "", fmt.Errorf("replace seed %s: %w", path, err)
	}
	return pub, nil
}

// writeNew creates path exclusively with mode and writes data, fsynced,
// and fsyncs its directory so that the new name is durable too.
func writeNew(path string, data []byte, mode os.FileMode) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, mode)
	if err != nil {
		if errors.Is(err, fs.ErrExist) {
			return fmt.Errorf("%s exists: %w", path, ErrExists)
		}
		return fmt.Errorf("create %s: %w", path, err)
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return fmt.Errorf("sync %s: %w", path, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("close %s: %w", path, err)
	}
	return syncDir(filepath.Dir(path))
}

func (u *Users) write(path string) error {
	sort.Slice(u.Users, func(i, j int) bool { return u.Users[i].Name < u.Users[j].Name })
	data, err := json.MarshalIndent(u, "", "  ")
	if err != nil {
		return err
	}
	tmp := path + ".tmp"
	_ = os.Remove(tmp)
	if err := writeNew(tmp, append(data, '\n'), 0o644); err != nil {
		return err
	}
	if err := replaceFile(tmp, path); err != nil {
		return fmt.Errorf("replace %s: %w", path, err)
	}
	return nil
}

// LoadUsers reads and validates a users file. A missing file wraps
// fs.ErrNotExist.
func LoadUsers(path string) (*Users, error) {
	data, err := readPrivate(path, false)
	if err != nil {
		return nil, err
	}
	var u Users
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&u); err != nil {
		return nil, fmt.Errorf("users file %s: %w: %w", path, ErrCredsFile, err)
	}
	if u.Version != UsersVersion {
		return nil, fmt.Errorf("users file %s: version %d, want %d: %w", path, u.Version, UsersVersion, ErrCredsFile)
	}
	names, keys := map[string]bool{}, map[string]bool{}
	for i, x := range u.Users {
		if err := x.Identity.Validate(); err != nil {
			return nil, fmt.Errorf("users file %s: user %d: %w", path, i, err)
		}
		if x.Name != x.Identity.Name() {
			return nil, fmt.Errorf("users file %s: user %d is named %q but its identity is %s: %w", path, i, x.Name, x.Identity.Name(), ErrCredsFile)
		}
		if !nkeys.IsValidPublicUserKey(x.NKey) {
			return nil, fmt.Errorf("users file %s: user %s: %q is not a public user nkey: %w", path, x.Name, x.NKey, ErrCredsFile)
		}
		if names[x.Name] || keys[x.NKey] {
			return nil, fmt.Errorf("users file %s: user %s or its nkey appears twice: %w", path, x.Name, ErrCredsFile)
		}
		names[x.Name], keys[x.NKey] = true, true
	}
	ids := make([]Identity, len(u.Users))
	for i, x := range u.Users {
		ids[i] = x.Identity
	}
	if err := instancesDisjoint(ids); err != nil {
		return nil, fmt.Errorf("users file %s: %w", path, err)
	}
	return &u, nil
}

// ServerUsers returns the embedded server's users: one nkey user per entry
// with the permission set of its role under prefix.
func (u *Users) ServerUsers(prefix string) []*server.NkeyUser {
	out := make([]*server.NkeyUser, 0, len(u.Users))
	for _, x := range u.Users {
		out = append(out, &server.NkeyUser{Nkey: x.NKey, Permissions: Permissions(x.Identity, prefix).serverPermissions()})
	}
	return out
}

// Stage says which engine acts for instance and as which pipeline stage:
// the engine's own instance, its PP size (1 without stages) and the
// stage (0 for the engine's own instance). ok is false when no engine
// identity of the file acts for instance.
func (u *Users) Stage(instance string) (engine string, pp, stage int, ok bool) {
	for _, x := range u.Users {
		if x.Role != RoleEngine {
			continue
		}
		for i, inst := range x.Instances() {
			if inst == instance {
				return x.Instance, max(x.PP, 1), max(i-1, 0), true
			}
		}
	}
	return "", 0, 0, false
}

// Lookup returns the identity of the user with public key nkey.
func (u *Users) Lookup(nkey string) (Identity, bool) {
	for _, x := range u.Users {
		if x.NKey == nkey {
			return x.Identity, true
		}
	}
	return Identity{}, false
}

// readPrivate reads a credentials file without following a symlink and
// without blocking on the open (a FIFO at the path would wait for a
// writer; the fstat below refuses it). It must be a regular file. With secret set, it must be owned by this
// process's user with no group or other permission bits; otherwise (the
// public users file, whose keys decide who may connect) it must be owned
// by this user or root and writable by no one else.
func readPrivate(path string, secret bool) ([]byte, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("credentials file %s: %w", path, err)
		}
		return nil, fmt.Errorf("open credentials file %s (symlinks are refused): %w: %w", path, ErrCredsFile, err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("credentials file %s is not a regular file: %w", path, ErrCredsFile)
	}
	sys, _ := st.Sys().(*syscall.Stat_t)
	if secret {
		if m := st.Mode().Perm(); m&0o077 != 0 {
			return nil, fmt.Errorf("secret file %s has mode %04o; want no group or other access (chmod 600): %w", path, m, ErrCredsFile)
		}
		if sys != nil && int(sys.Uid) != os.Geteuid() {
			return nil, fmt.Errorf("secret file %s is owned by uid %d, not %d: %w", path, sys.Uid, os.Geteuid(), ErrCredsFile)
		}
	} else {
		if m := st.Mode().Perm(); m&0o022 != 0 {
			return nil, fmt.Errorf("credentials file %s has mode %04o; others could add keys to it (chmod 644): %w", path, m, ErrCredsFile)
		}
		if sys != nil && int(sys.Uid) != os.Geteuid() && sys.Uid != 0 {
			return nil, fmt.Errorf("credentials file %s is owned by uid %d, neither %d nor root: %w", path, sys.Uid, os.Geteuid(), ErrCredsFile)
		}
	}
	if st.Size() > 1<<20 {
		return nil, fmt.Errorf("credentials file %s is %d B, over 1 MiB: %w", path, st.Size(), ErrCredsFile)
	}
	data := make([]byte, st.Size())
	if _, err := f.ReadAt(data, 0); err != nil && st.Size() > 0 {
		return nil, fmt.Errorf("read %s: %w", path, err)
	}
	return data, nil
}

// Seed is a loaded identity seed.
type Seed struct {
	kp  nkeys.KeyPair
	pub string
}

// LoadSeed reads a seed file (0600, owned by this user, no symlink).
func LoadSeed(path string) (*Seed, error) {
	data, err := readPrivate(path, true)
	if err != nil {
		return nil, err
	}
	kp, err := nkeys.FromSeed(bytes.TrimSpace(data))
	if err != nil {
		return nil, fmt.Errorf("seed file %s: %w: %w", path, ErrCredsFile, err)
	}
	pub, err := kp.PublicKey()
	if err != nil {
		return nil, fmt.Errorf("seed file %s: %w: %w", path, ErrCredsFile, err)
	}
	if !nkeys.IsValidPublicUserKey(pub) {
		return nil, fmt.Errorf("seed file %s holds no user nkey: %w", path, ErrCredsFile)
	}
	return &Seed{kp: kp, pub: pub}, nil
}

// PublicKey is the seed's public nkey.
func (s *Seed) PublicKey() string { return s.pub }

// Sign signs data with the seed (also used for signed cluster metadata).
func (s *Seed) Sign(data []byte) ([]byte, error) { return s.kp.Sign(data) }

// Verify checks sig over data against public user key pub.
func Verify(pub string, data, sig []byte) error {
	kp, err := nkeys.FromPublicKey(pub)
	if err != nil {
		return fmt.Errorf("public key %q: %w: %w", pub, ErrCredsFile, err)
	}
	return kp.Verify(data, sig)
}

// ClientOptions returns the NATS connect options of identity id holding
// seed: the nkey signature and the identity's inbox prefix.
func ClientOptions(id Identity, seed *Seed) []nats.Option {
	return []nats.Option{
		nats.Nkey(seed.pub, seed.kp.Sign),
		nats.CustomInboxPrefix(id.InboxPrefix()),
	}
}

// LoadGossipKeys reads a gossip key file (0600, no symlink): one base64
// key of 16, 24 or 32 bytes per line. The first line is the primary key
// (gossip is sent with it); later lines are accepted while a rotation is
// rolled out (cluster.Config.SecondaryKeys). Blank lines and lines
// starting with '#' are skipped.
func LoadGossipKeys(path string) (primary []byte, secondary [][]byte, err error) {
	data, err := readPrivate(path, true)
	if err != nil {
		return nil, nil, err
	}
	var keys [][]byte
	for n, line := range bytes.Split(data, []byte("\n")) {
		line = bytes.TrimSpace(line)
		if len(line) == 0 || line[0] == '#' {
			continue
		}
		key, err := base64.StdEncoding.DecodeString(string(line))
		if err != nil {
			return nil, nil, fmt.Errorf("gossip key file %s line %d is not base64: %w: %w", path, n+1, ErrCredsFile, err)
		}
		if l := len(key); l != 16 && l != 24 && l != 32 {
			return nil, nil, fmt.Errorf("gossip key file %s line %d holds %d bytes; want 16, 24 or 32: %w", path, n+1, l, ErrCredsFile)
		}
		keys = append(keys, key)
	}
	if len(keys) == 0 {
		return nil, nil, fmt.Errorf("gossip key file %s holds no key: %w", path, ErrCredsFile)
	}
	return keys[0], keys[1:], nil
}

// MinStorageKeyBytes is the shortest storage MAC key LoadStorageKey
// accepts.
const MinStorageKeyBytes = 32

// InitStorageKey writes a new storage MAC key (32 random bytes, base64,
// mode 0600) into dir, touching nothing else there: for a directory made
// before 'coordinator init' wrote one as well. It refuses to overwrite a
// key (ErrExists): objects MACed with the old one would no longer be
// announced after a restart (docs/storage-mac.md: rotation).
func InitStorageKey(dir string) error {
	key := make([]byte, 32)
	if _, err := rand.Read(key); err != nil {
		return fmt.Errorf("storage key: %w", err)
	}
	return writeNew(filepath.Join(dir, StorageKeyFile), []byte(base64.StdEncoding.EncodeToString(key)+"\n"), 0o600)
}

// LoadStorageKey reads a storage MAC key file: a regular file (no
// symlink) owned by this user with no group or other access, holding one
// base64 key of at least MinStorageKeyBytes. A missing file wraps
// fs.ErrNotExist.
func LoadStorageKey(path string) ([]byte, error) {
	data, err := readPrivate(path, true)
	if err != nil {
		return nil, err
	}
	key, err := base64.StdEncoding.DecodeString(string(bytes.TrimSpace(data)))
	if err != nil {
		return nil, fmt.Errorf("storage key file %s is not one base64 key: %w: %w", path, ErrCredsFile, err)
	}
	if len(key) < MinStorageKeyBytes {
		return nil, fmt.Errorf("storage key file %s holds %d bytes; want at least %d: %w", path, len(key), MinStorageKeyBytes, ErrCredsFile)
	}
	return key, nil
}
