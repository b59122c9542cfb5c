package rankd

import (
	"sort"
	"strings"

	"github.com/kvtier/kvtier/cluster"
)

// clusterNATS returns the NATS URLs gossiped by every alive coordinator in
// members that trusted accepts, comma-separated: sorted by coordinator
// name, each URL once. With several coordinators (each embedding one
// server of a NATS cluster) the rank holds every server's URL, so it can
// move to a surviving one when one dies. "" when no coordinator gossips a
// URL.
func clusterNATS(members []cluster.Member, trusted func(cluster.Member) bool) string {
	var coords []cluster.Member
	for _, m := range members {
		if m.Meta.Role == cluster.RoleCoordinator && m.State == cluster.StateAlive && len(m.Meta.NATS) > 0 && trusted(m) {
			coords = append(coords, m)
		}
	}
	sort.Slice(coords, func(i, j int) bool { return coords[i].Name < coords[j].Name })
	seen := map[string]bool{}
	var urls []string
	for _, m := range coords {
		for _, u := range m.Meta.NATS {
			if u = strings.TrimSpace(u); u != "" && !seen[u] {
				seen[u] = true
				urls = append(urls, u)
			}
		}
	}
	return strings.Join(urls, ",")
}
