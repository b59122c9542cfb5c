package campaign

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/kvtier/kvtier/coordinator"
	"github.com/kvtier/kvtier/wire"
)

// sample records, every 2 s, the placements the index serves for recent
// prompts (acknowledged placements), the daemons' memory and new log
// lines.
func (r *runner) sample(ctx context.Context) {
	t := time.NewTicker(2 * time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		r.mu.Lock()
		ps := r.prompts
		if len(ps) > 6 {
			ps = append(append([]*prompt(nil), ps[len(ps)-5:]...), ps[rand.IntN(len(ps)-5)])
		}
		r.mu.Unlock()
		for _, p := range ps {
			r.recordIndex(ctx, p)
		}
		r.sampleRaft(ctx)
		r.sampleRSS()
		r.scanLogs(false)
	}
}

// objects asks the coordinator for every copy of p's objects.
func (r *runner) objects(ctx context.Context, p *prompt) ([]wire.ObjectInfo, error) {
	rep, err := adminCall[wire.AdminObjectReply](ctx, r.c, wire.AdminObject,
		wire.AdminObjectRequest{Namespace: p.ns, Chunks: p.hashes, Instance: Instance})
	if err != nil {
		return nil, err
	}
	return rep.Objects, nil
}

func (r *runner) recordIndex(ctx context.Context, p *prompt) {
	objs, err := r.objects(ctx, p)
	if err != nil {
		return
	}
	now := time.Now()
	for _, o := range objs {
		for _, pl := range o.Placements {
			r.led.see(placementID{Key: o.Key.String(), Holder: pl.Holder.String(), Tier: pl.Tier}, pl.Incarnation, pl.Size, pl.Sum, now)
		}
	}
}

// sampleRaft reads every coordinator's raft state: two leaders of one
// term would be a split brain (a problem); the leader's commit index is
// reported.
func (r *runner) sampleRaft(ctx context.Context) {
	if !r.c.raftMode() {
		return
	}
	nodes, _ := coordinator.CollectRaft(ctx, r.c.admin, r.c.subj, 300*time.Millisecond)
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.leaders == nil {
		r.leaders = map[uint64]string{}
	}
	for _, n := range nodes {
		if n.State != "Leader" {
			continue
		}
		if prev, ok := r.leaders[n.Term]; ok && prev != n.ID {
			r.rep.Problems = append(r.rep.Problems, fmt.Sprintf("raft term %d has two leaders: %s and %s", n.Term, prev, n.ID))
		}
		if _, ok := r.leaders[n.Term]; !ok {
			r.leaders[n.Term] = n.ID
			r.rep.Leaders++
		}
		r.rep.CommitIndex = n.CommitIndex
	}
}

func (r *runner) sampleRSS() {
	for _, p := range append(r.c.coordProcs(), r.c.ranks...) {
		v := p.rssBytes()
		r.mu.Lock()
		if v > r.maxRSS[p.name] {
			r.maxRSS[p.name] = v
		}
		over := v > r.cfg.MaxRSS
		r.mu.Unlock()
		if over {
			r.problemOnce("rss:"+p.name, "%s RSS %d MiB over the bound %d MiB", p.name, v>>20, r.cfg.MaxRSS>>20)
		}
	}
}

func (r *runner) problemOnce(key, format string, args ...any) {
	r.mu.Lock()
	if r.logOff["once:"+key] != 0 {
		r.mu.Unlock()
		return
	}
	r.logOff["once:"+key] = 1
	r.rep.RSSOver = append(r.rep.RSSOver, fmt.Sprintf(format, args...))
	r.mu.Unlock()
}

// panicMarkers are log lines no daemon may print.
var panicMarkers = []string{"panic:", "fatal error:", "DATA RACE", "[signal SIG"}

// scanLogs reads the new part of every daemon log for panics.
func (r *runner) scanLogs(final bool) {
	files, _ := filepath.Glob(filepath.Join(r.c.logD, "*.log"))
	for _, path := range files {
		if filepath.Base(path) == "engine.log" {
			continue
		}
		r.mu.Lock()
		off := r.logOff[path]
		r.mu.Unlock()
		f, err := os.Open(path)
		if err != nil {
			continue
		}
		if _, err := f.Seek(off, io.SeekStart); err != nil {
			f.Close()
			continue
		}
		br := bufio.NewReaderSize(f, 1<<20)
		n := off
		for {
			line, err := br.ReadString('\n')
			if err != nil && (!final || line == "") {
				break // a partial last line is read again next time
			}
			n += int64(len(line))
			for _, m := range panicMarkers {
				if strings.Contains(line, m) {
					r.mu.Lock()
					r.rep.Panics = append(r.rep.Panics, filepath.Base(path)+": "+strings.TrimSpace(line))
					r.mu.Unlock()
				}
			}
			if err != nil {
				break
			}
		}
		f.Close()
		r.mu.Lock()
		r.logOff[path] = n
		r.mu.Unlock()
	}
}
