package deploy

import (
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"testing"
)

type gridPanel struct {
	ID      int    `json:"id"`
	Title   string `json:"title"`
	GridPos struct {
		H, W, X, Y int
	} `json:"gridPos"`
}

// layoutErrors returns one error per panel outside Grafana's 24-column
// grid, without a size, or overlapping an earlier one (Grafana would push
// it elsewhere and the dashboard would not look as written).
func layoutErrors(ps []gridPanel) []error {
	var errs []error
	for i, p := range ps {
		g := p.GridPos
		if g.W <= 0 || g.H <= 0 || g.X < 0 || g.Y < 0 || g.X+g.W > 24 {
			errs = append(errs, fmt.Errorf("panel %d %q: gridPos x=%d y=%d w=%d h=%d is outside the 24-column grid", p.ID, p.Title, g.X, g.Y, g.W, g.H))
			continue
		}
		for _, q := range ps[:i] {
			o := q.GridPos
			if g.X < o.X+o.W && o.X < g.X+g.W && g.Y < o.Y+o.H && o.Y < g.Y+g.H {
				errs = append(errs, fmt.Errorf("panel %d %q (x=%d y=%d w=%d h=%d) overlaps panel %d %q (x=%d y=%d w=%d h=%d)",
					p.ID, p.Title, g.X, g.Y, g.W, g.H, q.ID, q.Title, o.X, o.Y, o.W, o.H))
			}
		}
	}
	return errs
}

func readLayout(t *testing.T, data []byte) []gridPanel {
	t.Helper()
	var d struct {
		Panels []gridPanel `json:"panels"`
	}
	if err := json.Unmarshal(data, &d); err != nil {
		t.Fatal(err)
	}
	return d.Panels
}

// TestDashboardLayout: the top-level panels (the rows are not collapsed)
// tile the grid without overlaps; a panel moved onto another is caught.
func TestDashboardLayout(t *testing.T) {
	data, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	for _, err := range layoutErrors(readLayout(t, data)) {
		t.Error(err)
	}
	// Panel 64 "Index rebuilds" moved onto panel 63 "Start-up refusals".
	ps := readLayout(t, data)
	for i := range ps {
		if ps[i].ID == 64 {
			ps[i].GridPos.X = 4
		}
	}
	var got []string
	for _, err := range layoutErrors(ps) {
		got = append(got, err.Error())
	}
	want := `panel 64 "Index rebuilds" (x=4 y=154 w=8 h=8) overlaps panel 63 "Start-up refusals" (x=0 y=154 w=8 h=8)`
	if strings.Join(got, "\n") != want {
		t.Fatalf("errors for the moved panel:\n%s\nwant:\n%s", strings.Join(got, "\n"), want)
	}
}
