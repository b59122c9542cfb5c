package cluster

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"
)

func TestLeaveMsgCodec(t *testing.T) {
	for _, m := range []leaveMsg{
		{Kind: kindLeaving, From: "rankd-0@1"},
		{Kind: kindAck, From: "coord@18446744073709551615", To: "rankd-0@1"},
	} {
		b := m.encode()
		got, err := decodeLeaveMsg(b)
		m.V = leaveMsgVersion
		if err != nil || got != m {
			t.Fatalf("%s decodes to %+v, %v; want %+v", b, got, err, m)
		}
	}
	long := strings.Repeat("n", 129) + "@1"
	for _, tc := range []struct{ in, rule string }{
		{`{"v":1,"k":"leaving","from":"a@1"}{}`, "trailing data"},
		{`{"v":2,"k":"leaving","from":"a@1"}`, "version 2"},
		{`{"v":1,"k":"join","from":"a@1"}`, `kind "join"`},
		{`{"v":1,"k":"leaving","from":"a"}`, `from "a" must be a member ID`},
		{`{"v":1,"k":"leaving","from":"@1"}`, "must be a member ID"},
		{`{"v":1,"k":"leaving","from":"a b@1"}`, "must be a member ID"},
		{`{"v":1,"k":"leaving","from":"` + long + `"}`, "must be a member ID"},
		{`{"v":1,"k":"leaving","from":"a@x"}`, "incarnation must be a decimal uint64"},
		{`{"v":1,"k":"leaving","from":"a@1","to":"b@2"}`, "names a recipient"},
		{`{"v":1,"k":"ack","from":"a@1"}`, `to "" must be a member ID`},
		{`{"v":1,"k":"ack","from":"a@1","to":"b@-2"}`, "incarnation must be a decimal uint64"},
		{`not json`, "decode leave message"},
		{``, "decode leave message"},
		{`{"v":1,"k":"leaving","from":"` + strings.Repeat("x", 600) + `@1"}`, "over 512 B"},
	} {
		_, err := decodeLeaveMsg([]byte(tc.in))
		if err == nil || !strings.Contains(err.Error(), tc.rule) || !errors.Is(err, errMessage) {
			t.Errorf("%.60q: err = %v, want errMessage naming %q", tc.in, err, tc.rule)
		}
	}
}

func FuzzDecodeLeaveMsg(f *testing.F) {
	f.Add(leaveMsg{Kind: kindLeaving, From: "rankd-0@1"}.encode())
	f.Add(leaveMsg{Kind: kindAck, From: "coord@2", To: "rankd-0@1"}.encode())
	f.Add([]byte(`{"v":1,"k":"ack","from":"a@1","to":""}`))
	f.Add([]byte(`null`))
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := decodeLeaveMsg(b)
		if err != nil {
			if !errors.Is(err, errMessage) {
				t.Fatalf("error %v wraps no sentinel", err)
			}
			return
		}
		if got, err := decodeLeaveMsg(m.encode()); err != nil || got != m {
			t.Fatalf("%+v re-encodes to %+v, %v", m, got, err)
		}
	})
}

// TestUpdateMetaCannotSetLeaving: only Leave sets Meta.Leaving.
func TestUpdateMetaCannotSetLeaving(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	cfg := testConfig(t, "rankd-0", rankdMeta(0))
	c, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Shutdown() })
	setLeaving := func(m *Meta) { m.Leaving = true; m.L1UsedBytes = 1 }
	if err := c.UpdateMeta(ctx, setLeaving); !errors.Is(err, ErrMeta) {
		t.Fatalf("setting leaving before Start: err = %v, want ErrMeta", err)
	}
	if err := c.Start(); err != nil {
		t.Fatal(err)
	}
	peer := startMember(t, testConfig(t, "coord", coordMeta()), c.LocalMember().Addr)
	waitConverged(t, []*Cluster{c, peer}, 5*time.Second)
	if err := c.UpdateMeta(ctx, setLeaving); !errors.Is(err, ErrMeta) {
		t.Fatalf("setting leaving: err = %v, want ErrMeta", err)
	}
	if m := c.LocalMember().Meta; m.Leaving || m.L1UsedBytes != 0 {
		t.Fatalf("a refused update changed the meta: %+v", m)
	}
	if m, _ := member(peer, c.LocalMember().ID); m.Meta.Leaving {
		t.Fatalf("peer sees leaving: %+v", m.Meta)
	}

	s := peer.Subscribe(0)
	if err := c.Leave(2 * time.Second); err != nil {
		t.Fatalf("Leave: %v", err)
	}
	if !c.LocalMember().Meta.Leaving {
		t.Fatal("Leave did not set leaving in the local meta")
	}
	// The peer saw the leaving meta (UpdateNode waited for its gossip)
	// before the leave itself.
	ev := nextEvent(t, s, 5*time.Second, func(ev Event) bool {
		return ev.Member.ID == c.LocalMember().ID && (ev.Type == EventUpdate || ev.Type == EventLeave || ev.Type == EventDead)
	})
	if ev.Type != EventUpdate || !ev.Member.Meta.Leaving {
		t.Fatalf("first event of the leaver: %s with %+v, want an update with leaving", ev.Type, ev.Member.Meta)
	}
	if err := c.UpdateMeta(ctx, func(m *Meta) { m.Leaving = false }); !errors.Is(err, ErrClosed) {
		t.Fatalf("clearing leaving after Leave: err = %v, want ErrClosed", err)
	}
}

// TestLeaveAnnouncementLost: a member that the leave announcement does not
// reach reports a death (the safe direction) while the others report a
// leave; a member that misses only the direct message but sees the leaving
// meta reports a leave.
func TestLeaveAnnouncementLost(t *testing.T) {
	for _, tc := range []struct {
		name string
		lose map[string]bool // what the deaf member drops: kindLeaving, "meta"
		want EventType
	}{
		{"message and meta lost", map[string]bool{kindLeaving: true, "meta": true}, EventDead},
		{"message lost, meta seen", map[string]bool{kindLeaving: true}, EventLeave},
	} {
		t.Run(tc.name, func(t *testing.T) {
			starvable(t, 3, 250*time.Millisecond, func(t testing.TB) {
				nodes := startCluster(t, 3, nil)
				coord, deaf, leaver := nodes[0], nodes[1], nodes[2]
				id := leaver.LocalMember().ID
				lose := func(what, from string) bool { return from == id && tc.lose[what] }
				deaf.lose.Store(&lose)
				sc, sd := coord.Subscribe(0), deaf.Subscribe(0)

				const timeout = time.Second
				t0 := time.Now()
				if err := leaver.Leave(timeout); err != nil {
					t.Fatalf("Leave: %v", err)
				}
				// The leaver waited for the deaf member's ack until half the
				// timeout, then left anyway.
				if took := time.Since(t0); took < timeout/2 {
					t.Fatalf("Leave returned after %v, before the announcement deadline %v", took, timeout/2)
				}
				if err := leaver.Shutdown(); err != nil {
					t.Fatalf("Shutdown: %v", err)
				}
				gone := func(ev Event) bool {
					return ev.Member.ID == id && (ev.Type == EventLeave || ev.Type == EventDead)
				}
				if ev := nextEvent(t, sc, 5*time.Second, gone); ev.Type != EventLeave || ev.Member.State != StateLeft {
					t.Fatalf("member that got the announcement: %s/%s, want leave/left", ev.Type, ev.Member.State)
				}
				ev := nextEvent(t, sd, 5*time.Second, gone)
				wantState := map[EventType]MemberState{EventLeave: StateLeft, EventDead: StateDead}[tc.want]
				if ev.Type != tc.want || ev.Member.State != wantState {
					t.Fatalf("member that lost %v: %s/%s, want %s/%s", tc.lose, ev.Type, ev.Member.State, tc.want, wantState)
				}
				if st := memberState(deaf, id); st != wantState {
					t.Fatalf("Members at the deaf member: %s, want %s", st, wantState)
				}
			})
		})
	}
}

// TestConcurrentLeaves: members leaving at once acknowledge each other's
// announcements, and every survivor reports every one as left. The cluster
// is encrypted and labelled, so the announcements go through memberlist's
// encrypted streams.
func TestConcurrentLeaves(t *testing.T) { starvable(t, 3, 250*time.Millisecond, concurrentLeaves) }

func concurrentLeaves(t testing.TB) {
	nodes := startCluster(t, 4, func(c *Config) {
		c.SecretKey = []byte("0123456789abcdef")
		c.Label = "kvtier-test"
	})
	s := nodes[0].Subscribe(0)
	leavers := nodes[1:]
	errs := make(chan error, len(leavers))
	for _, l := range leavers {
		go func() {
			err := l.Leave(2 * time.Second)
			if err != nil {
				err = fmt.Errorf("%s: %w", l.LocalMember().ID, err)
			}
			errs <- err
		}()
	}
	for range leavers {
		if err := <-errs; err != nil {
			t.Fatalf("Leave: %v", err)
		}
	}
	for _, l := range leavers {
		_ = l.Shutdown()
	}
	seen := map[string]EventType{}
	for len(seen) < len(leavers) {
		ev := nextEvent(t, s, 5*time.Second, func(ev Event) bool { return ev.Type == EventLeave || ev.Type == EventDead })
		seen[ev.Member.ID] = ev.Type
	}
	for _, l := range leavers {
		if typ := seen[l.LocalMember().ID]; typ != EventLeave {
			t.Errorf("%s reported as %s, want leave", l.LocalMember().ID, typ)
		}
	}
}

func TestJudgeAttempt(t *testing.T) {
	ms := time.Millisecond
	for _, tc := range []struct {
		failed      bool
		lag         time.Duration
		i, attempts int
		want        attemptVerdict
	}{
		{false, 5 * ms, 1, 3, attemptPassed},
		{false, 900 * ms, 3, 3, attemptPassed}, // a pass under starvation is still a pass
		{true, 250 * ms, 1, 3, attemptFailed},  // responsive machine: the failure is real
		{true, 251 * ms, 1, 3, attemptRetry},
		{true, 2000 * ms, 3, 3, attemptSkip},
	} {
		if got := judgeAttempt(tc.failed, tc.lag, 250*ms, tc.i, tc.attempts); got != tc.want {
			t.Errorf("judgeAttempt(failed %v, lag %v, attempt %d of %d) = %d, want %d",
				tc.failed, tc.lag, tc.i, tc.attempts, got, tc.want)
		}
	}
}
