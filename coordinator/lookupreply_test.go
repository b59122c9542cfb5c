package coordinator

import (
	"encoding/json"
	"testing"

	"github.com/kvtier/kvtier/wire"
)

// TestAppendLookupReply: the hand-written lookup reply is byte for byte
// what json.Marshal writes for the same reply, and an instance name that
// would need escaping is left to json.Marshal. Seen failing first with the
// separator after the instance left out ({"ok":{"instance":"eng""prefix":..).
func TestAppendLookupReply(t *testing.T) {
	for _, c := range []struct {
		instance string
		prefix   int
	}{{"eng", 128}, {"", 0}, {"A-z_09", 7}, {"x", -1}, {"eng", 1 << 40}} {
		want, err := json.Marshal(okReply{OK: &wire.LookupReply{Instance: c.instance, Prefix: c.prefix}})
		if err != nil {
			t.Fatal(err)
		}
		got, ok := appendLookupReply([]byte("junk"), c.instance, c.prefix)
		if !ok || string(got) != "junk"+string(want) {
			t.Errorf("%q %d: got %q (%v), want %q", c.instance, c.prefix, got, ok, want)
		}
	}
	for _, inst := range []string{`a"b`, `a\b`, "é", "a b", "<x>"} {
		if got, ok := appendLookupReply(nil, inst, 1); ok {
			t.Errorf("%q: encoded by hand as %q, want the json.Marshal fallback", inst, got)
		}
	}
}
