package cuda

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
)

func TestParseShmName(t *testing.T) {
	for _, c := range []struct {
		name  string
		pid   int
		event bool
		ok    bool
	}{
		{"kvtier-123-0123456789abcdef", 123, false, true},
		{"kvtier-4194304-0123456789abcdef.event", 4194304, true, true},
		{"kvtier-123-0123456789ABCDEF", 0, false, false}, // upper-case hex is not ours
		{"kvtier-123-0123456789abcde", 0, false, false},  // short
		{"kvtier-123-0123456789abcdef0", 0, false, false},
		{"kvtier-0-0123456789abcdef", 0, false, false},
		{"kvtier--0123456789abcdef", 0, false, false},
		{"kvtier-12345678901-0123456789abcdef", 0, false, false},
		{"kvtier-1x3-0123456789abcdef", 0, false, false},
		{"../kvtier-123-0123456789abcdef", 0, false, false},
		{"kvtier-123-0123456789abcdef/../../etc", 0, false, false},
		{"kvtier-123-0123456789abcdef.evt", 0, false, false},
		{"other-123-0123456789abcdef", 0, false, false},
		{"", 0, false, false},
	} {
		pid, event, ok := parseShmName(c.name)
		if pid != c.pid || event != c.event || ok != c.ok {
			t.Errorf("parseShmName(%q) = %d, %v, %v; want %d, %v, %v", c.name, pid, event, ok, c.pid, c.event, c.ok)
		}
	}
	for _, event := range []bool{false, true} {
		name, err := newShmName(event)
		if err != nil {
			t.Fatal(err)
		}
		if _, ev, ok := parseShmName(name); !ok || ev != event {
			t.Errorf("newShmName(%v) = %q does not parse back", event, name)
		}
	}
}

func TestParseSpec(t *testing.T) {
	for _, c := range []struct {
		spec string
		want deviceSpec
		bad  bool
	}{
		{spec: "auto", want: deviceSpec{kind: SpecAuto}},
		{spec: "host", want: deviceSpec{kind: SpecHost}},
		{spec: "cuda", want: deviceSpec{kind: SpecCUDA}},
		{spec: "cuda:0", want: deviceSpec{kind: SpecCUDA}},
		{spec: "cuda:7", want: deviceSpec{kind: SpecCUDA, ordinal: 7}},
		{spec: "GPU-5f3c2a10-1b2c-3d4e-5f60-718293a4b5c6", want: deviceSpec{kind: "uuid", uuid: "GPU-5f3c2a10-1b2c-3d4e-5f60-718293a4b5c6"}},
		{spec: "", bad: true},
		{spec: "Auto", bad: true},
		{spec: "cuda:", bad: true},
		{spec: "cuda:-1", bad: true},
		{spec: "cuda:+1", bad: true},
		{spec: "cuda:1x", bad: true},
		{spec: "cuda:99999999999999999999", bad: true},
		{spec: "gpu:0", bad: true},
		{spec: "GPU-", bad: true},
		{spec: " host", bad: true},
	} {
		got, err := parseSpec(c.spec)
		if c.bad {
			if !errors.Is(err, ErrBadSpec) {
				t.Errorf("parseSpec(%q) = %+v, %v; want ErrBadSpec", c.spec, got, err)
			}
			continue
		}
		if err != nil || got != c.want {
			t.Errorf("parseSpec(%q) = %+v, %v; want %+v", c.spec, got, err, c.want)
		}
	}
}

// Open by UUID trusts the opened device's UUID, not NVML's index.
func TestOpenUUID(t *testing.T) {
	uuids := []string{"GPU-aaaa", "GPU-bbbb", "GPU-cccc"}
	listed := func() ([]Info, error) {
		var infos []Info
		for i, u := range uuids {
			infos = append(infos, Info{Backend: "cuda", Ordinal: i, UUID: u})
		}
		return infos, nil
	}
	// CUDA ordinals in another order than NVML's: ordinal i is uuids[perm[i]].
	opener := func(t *testing.T, perm []int, opened *[]int) func(int) (Device, error) {
		return func(ordinal int) (Device, error) {
			*opened = append(*opened, ordinal)
			if ordinal >= len(perm) {
				return nil, fmt.Errorf("%w: ordinal %d", ErrNoDriver, ordinal)
			}
			dir := t.TempDir()
			if err := os.Chmod(dir, 0o700); err != nil {
				return nil, err
			}
			return OpenHost(HostConfig{Dir: dir, UUID: uuids[perm[ordinal]]})
		}
	}
	for _, c := range []struct {
		name       string
		uuid       string
		perm       []int
		wantOpened []int
	}{
		{"index is the ordinal", "GPU-bbbb", []int{0, 1, 2}, []int{1}},
		{"ordinals reordered", "GPU-bbbb", []int{2, 0, 1}, []int{1, 0, 2}},
		{"device hidden from CUDA", "GPU-cccc", []int{2, 0}, []int{2, 0}},
	} {
		t.Run(c.name, func(t *testing.T) {
			var opened []int
			dev, err := openUUID(c.uuid, listed, opener(t, c.perm, &opened))
			if err != nil {
				t.Fatal(err)
			}
			defer dev.Close()
			if got := dev.Info().UUID; got != c.uuid {
				t.Fatalf("opened %s, want %s", got, c.uuid)
			}
			if fmt.Sprint(opened) != fmt.Sprint(c.wantOpened) {
				t.Fatalf("opened ordinals %v, want %v", opened, c.wantOpened)
			}
		})
	}
	t.Run("not listed", func(t *testing.T) {
		var opened []int
		_, err := openUUID("GPU-dddd", listed, opener(t, []int{0, 1, 2}, &opened))
		if !errors.Is(err, ErrNoDriver) || len(opened) != 0 {
			t.Fatalf("err %v, opened %v; want ErrNoDriver, none", err, opened)
		}
	})
	t.Run("listed but no ordinal opens it", func(t *testing.T) {
		var opened []int
		_, err := openUUID("GPU-cccc", listed, opener(t, []int{0, 1}, &opened))
		if !errors.Is(err, ErrNoDriver) || !strings.Contains(err.Error(), "GPU-cccc") {
			t.Fatalf("err %v; want ErrNoDriver naming the UUID", err)
		}
	})
	t.Run("no NVML", func(t *testing.T) {
		_, err := openUUID("GPU-aaaa", func() ([]Info, error) {
			return nil, fmt.Errorf("%w: test", ErrNoDriver)
		}, nil)
		if !errors.Is(err, ErrNoDriver) {
			t.Fatalf("err %v; want ErrNoDriver", err)
		}
	})
}

// On this machine Discover either lists devices or says there is no driver;
// it never panics.
func TestDiscoverHere(t *testing.T) {
	infos, err := Discover()
	if err != nil {
		if !errors.Is(err, ErrNoDriver) {
			t.Fatalf("Discover: %v; want ErrNoDriver when it fails", err)
		}
		t.Logf("no GPU here: %v", err)
		return
	}
	for _, in := range infos {
		if in.Backend != "cuda" || !strings.HasPrefix(in.UUID, "GPU-") {
			t.Errorf("Discover: %+v", in)
		}
	}
}
