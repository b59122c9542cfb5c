package rankd

import (
	"testing"

	"github.com/kvtier/kvtier/cluster"
)

func TestClusterNATS(t *testing.T) {
	coord := func(name string, state cluster.MemberState, urls ...string) cluster.Member {
		return cluster.Member{Name: name, State: state, Meta: cluster.Meta{Role: cluster.RoleCoordinator, NATS: urls}}
	}
	rank := cluster.Member{Name: "rankd-engine0-0", State: cluster.StateAlive,
		Meta: cluster.Meta{Role: cluster.RoleRankd, NATS: []string{"nats://10.0.0.9:4222"}}}
	all := func(cluster.Member) bool { return true }
	for _, tc := range []struct {
		name    string
		members []cluster.Member
		trusted func(cluster.Member) bool
		want    string
	}{
		{"none", nil, all, ""},
		{"one coordinator", []cluster.Member{coord("c1", cluster.StateAlive, "nats://10.0.0.1:4222")}, all, "nats://10.0.0.1:4222"},
		{"three, by name, each URL once",
			[]cluster.Member{
				coord("c3", cluster.StateAlive, "nats://10.0.0.3:4222"),
				coord("c1", cluster.StateAlive, "nats://10.0.0.1:4222", "nats://10.0.0.2:4222"),
				coord("c2", cluster.StateAlive, "nats://10.0.0.2:4222"),
				rank,
			}, all, "nats://10.0.0.1:4222,nats://10.0.0.2:4222,nats://10.0.0.3:4222"},
		{"a dead coordinator's URLs are left out",
			[]cluster.Member{coord("c1", cluster.StateDead, "nats://10.0.0.1:4222"), coord("c2", cluster.StateAlive, "nats://10.0.0.2:4222")},
			all, "nats://10.0.0.2:4222"},
		{"an untrusted coordinator's URLs are left out (C9)",
			[]cluster.Member{coord("c1", cluster.StateAlive, "nats://10.6.6.6:4222"), coord("c2", cluster.StateAlive, "nats://10.0.0.2:4222")},
			func(m cluster.Member) bool { return m.Name != "c1" }, "nats://10.0.0.2:4222"},
	} {
		if got := clusterNATS(tc.members, tc.trusted); got != tc.want {
			t.Errorf("%s: %q, want %q", tc.name, got, tc.want)
		}
	}
}
