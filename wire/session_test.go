package wire

import (
	"errors"
	"strings"
	"testing"
)

func TestCheckSessionID(t *testing.T) {
	for _, c := range []struct {
		id, want string
	}{
		{strings.Repeat("0123456789abcdef", 2), ""},
		{"", "0 characters, want 32"},
		{strings.Repeat("a", 31), "31 characters, want 32"},
		{strings.Repeat("a", 33), "33 characters, want 32"},
		{strings.Repeat("a", 31) + "G", `character 31 is 'G'`},
		{strings.Repeat("A", 32), `character 0 is 'A', want lowercase hex`},
		{strings.Repeat("a", 30) + "\x00a", `character 30 is '\x00'`},
	} {
		err := CheckSessionID(c.id)
		switch {
		case c.want == "" && err != nil:
			t.Errorf("%q: %v", c.id, err)
		case c.want != "" && (!errors.Is(err, ErrMalformed) || !strings.Contains(err.Error(), c.want)):
			t.Errorf("%q: %v, want ErrMalformed naming %q", c.id, err, c.want)
		}
	}
}
