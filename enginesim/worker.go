package enginesim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// worker is one engine worker: one TP rank, its device and KV pools.
type worker struct {
	t      int
	rank   wire.Rank
	plan   *Plan
	dev    cuda.Device
	allocs []cuda.Mem // per group: all layers, LayerStride apart
	stream cuda.Stream
	nc     *nats.Conn
	subj   wire.Subjects
	log    func(format string, args ...any)
	// session is the rankd session of this process's registration; every
	// store, retrieve and release names it.
	session string
	// resend is the retry policy of store (Config.ResendAfter);
	// resendEvery > 0 resends a registration, as the same message, after
	// that long without a reply.
	resend      bus.Retry
	resendEvery time.Duration
	// jsonRequests sends stores and retrieves as JSON (Config.JSONRequests).
	jsonRequests bool
	// stateEvery is Config.StateEvery (see stateKept).
	stateEvery int
}

// body is a store or retrieve request as this engine sends it: binary
// (wire/reqbin.go), or JSON with jsonRequests.
func (w *worker) body(req interface{ MarshalBinary() ([]byte, error) }) (any, error) {
	if w.jsonRequests {
		return req, nil
	}
	b, err := req.MarshalBinary()
	if err != nil {
		return nil, fmt.Errorf("rank %d: %w", w.t, err)
	}
	return bus.Raw(b), nil
}

// withDeadline sends body with ctx's deadline, the request's bound, as the
// engine's (wire.HeaderDeadline): the engine holds the blocks until the
// store answers, so the rankd must not keep it waiting past it on L1 room.
func withDeadline(ctx context.Context, body any) any {
	dl, ok := ctx.Deadline()
	if !ok {
		return body
	}
	return bus.Headed{Header: nats.Header{wire.HeaderDeadline: []string{wire.FormatDeadline(dl)}}, Body: body}
}

func openWorker(t int, instance string, plan *Plan, spec string, hostCfg cuda.HostConfig, nc *nats.Conn,
	subj wire.Subjects, logf func(string, ...any)) (*worker, error) {
	dev, err := cuda.Open(spec, hostCfg)
	if err != nil {
		return nil, fmt.Errorf("rank %d: open device %q: %w", t, spec, err)
	}
	w := &worker{t: t, rank: wire.Rank{Instance: instance, TPRank: t}, plan: plan, dev: dev, nc: nc, subj: subj, log: logf,
		resend: bus.NoResponders()}
	if w.stream, err = dev.NewStream(); err != nil {
		w.close()
		return nil, fmt.Errorf("rank %d: new stream: %w", t, err)
	}
	for gi := range plan.R.Geometry {
		m, err := dev.Alloc(plan.AllocBytes(gi))
		if err != nil {
			w.close()
			return nil, fmt.Errorf("rank %d: allocate %d B for group %s: %w", t, plan.AllocBytes(gi), plan.R.Groups[gi].Name, err)
		}
		w.allocs = append(w.allocs, m)
		// In pieces: a pool with block ids near 2^31 is gigabytes.
		size := plan.AllocBytes(gi)
		img := make([]byte, min(size, padPiece))
		for off := uint64(0); off < size; off += uint64(len(img)) {
			piece := img[:min(uint64(len(img)), size-off)]
			plan.BlankRange(gi, off, piece)
			if err := dev.Write(m, off, piece); err != nil {
				w.close()
				return nil, fmt.Errorf("rank %d: initialize group %s: %w", t, plan.R.Groups[gi].Name, err)
			}
		}
	}
	return w, nil
}

// release tells the rankd the engine is going away: it drops its imports
// of the pools (the objects stay in L1 and L2). Best effort.
func (w *worker) release(ctx context.Context) error {
	type releaseRequest struct {
		Namespace dcp.Namespace `json:"namespace"`
		Session   string        `json:"session"`
	}
	req := releaseRequest{Namespace: w.plan.R.Namespace, Session: w.session}
	_, err := bus.CallRetry[releaseRequest](ctx, w.nc, w.subj.Engine(w.rank, "release"), req, bus.NoResponders())
	return sessionErr(w, "release", err)
}

func (w *worker) close() {
	if w.stream != nil {
		_ = w.stream.Close()
	}
	for _, m := range w.allocs {
		_ = m.Release()
	}
	_ = w.dev.Close()
}

// register exports every layer's pool (a view of the group's allocation at
// the layer's offset: the handle carries the offset) and registers them,
// keeping the session the rankd answers. This is the engine's start (or
// restart) path, the only one that registers: a registration supersedes
// any live session of the instance on that rank. A request later refused
// with stale_session means another process of the instance registered
// since; the simulator then fails rather than re-registering, which would
// take the pools away from that process in turn.
func (w *worker) register(ctx context.Context) error {
	req := wire.RegisterRequest{Spec: w.plan.Scenario.Spec, DeviceUUID: w.dev.Info().UUID}
	for gi, g := range w.plan.R.Geometry {
		for l := range g.Layers {
			h, err := w.dev.ExportMem(w.allocs[gi], uint64(l)*w.plan.LayerStride[gi], w.plan.PoolBytes[gi])
			if err != nil {
				return fmt.Errorf("rank %d: export group %d layer %d: %w", w.t, gi, l, err)
			}
			req.Pools = append(req.Pools, wire.PoolRegistration{Group: gi, Layer: l, Handle: h})
		}
	}
	var rep *wire.RegisterReply
	var err error
	if w.resendEvery > 0 {
		rep, err = callResending[wire.RegisterReply](ctx, w.nc, w.subj.Engine(w.rank, "register"), req, w.resendEvery)
	} else {
		rep, err = bus.CallRetry[wire.RegisterReply](ctx, w.nc, w.subj.Engine(w.rank, "register"), req, bus.NoResponders())
	}
	if err != nil {
		return fmt.Errorf("rank %d: register: %w", w.t, err)
	}
	if rep.Namespace != w.plan.R.Namespace {
		return fmt.Errorf("rank %d: register answered namespace %s, the spec's is %s", w.t, rep.Namespace, w.plan.R.Namespace)
	}
	if err := wire.CheckSessionID(rep.Session); err != nil {
		return fmt.Errorf("rank %d: register answered no usable session: %w", w.t, err)
	}
	w.session = rep.Session
	if rep.Superseded != "" {
		w.log("rank %d: registration superseded session %s of instance %s (an earlier engine process)", w.t, rep.Superseded, w.rank.Instance)
	}
	return nil
}

// callResending sends req and, while no reply came within every, sends
// the very same message again: same bytes, same reply subject. A rankd
// takes such a resend for one request delivered twice and answers it
// with the session of its first delivery (a fresh request would register
// again and supersede that session, and a late first registration would
// supersede the second). A no-responders answer is resent too.
func callResending[T any](ctx context.Context, nc *nats.Conn, subject string, req any, every time.Duration) (*T, error) {
	data, err := json.Marshal(req)
	if err != nil {
		return nil, fmt.Errorf("encode request for %s: %w", subject, err)
	}
	inbox := nc.NewInbox()
	sub, err := nc.SubscribeSync(inbox)
	if err != nil {
		return nil, fmt.Errorf("request %s: subscribe %s: %w", subject, inbox, err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	for {
		if err := nc.PublishRequest(subject, inbox, data); err != nil && !errors.Is(err, nats.ErrConnectionReconnecting) {
			return nil, fmt.Errorf("request %s: %w", subject, err)
		}
		actx, cancel := context.WithTimeout(ctx, every)
		msg, err := sub.NextMsgWithContext(actx)
		cancel()
		if ctx.Err() != nil {
			return nil, fmt.Errorf("request %s: %w", subject, ctx.Err())
		}
		if err != nil || msg.Header.Get("Status") == "503" {
			continue // lost, or nobody subscribed yet: the same message again
		}
		var rep wire.Reply[T]
		if err := json.Unmarshal(msg.Data, &rep); err != nil {
			return nil, fmt.Errorf("decode reply from %s: %w", subject, errors.Join(err, wire.ErrMalformed))
		}
		if rep.Error != nil {
			return nil, rep.Error
		}
		if rep.OK == nil {
			return nil, fmt.Errorf("reply from %s has neither ok nor error: %w", subject, wire.ErrMalformed)
		}
		return rep.OK, nil
	}
}

// sessionErr explains a stale_session refusal: this process was superseded.
func sessionErr(w *worker, op string, err error) error {
	var we *wire.Error
	if errors.As(err, &we) && we.Code == wire.CodeStaleSession {
		return fmt.Errorf("rank %d: %s refused, session %s was superseded by another registration of instance %s (not re-registering): %w",
			w.t, op, w.session, w.rank.Instance, err)
	}
	return err
}

// storeResult is the outcome of one store request.
type storeResult struct {
	chunk   int
	stored  int
	deduped int
	err     error
}

// computeAndStore plays the engine's forward passes: for each chunk it
// writes the chunk's pages through the stream (after a delay standing for
// the model's compute), records a fresh interprocess event behind them and
// sends a store request carrying that event at once, before the device has
// written anything, as an engine does. Every store of the prompt shares one
// request id; each keeps its own event until its reply (C1).
func (w *worker) computeAndStore(ctx context.Context, reqID string, compute time.Duration) ([]storeResult, error) {
	p := w.plan
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		results []storeResult
		keep    [][]byte // page buffers the stream still reads
	)
	for c := range p.Scenario.Chunks {
		if err := w.stream.Delay(compute); err != nil {
			return nil, err
		}
		// Pos: the chunk's place in the prompt, as these stores run
		// concurrently and reach the rankd in any order (its L2 bound
		// keeps a prompt's lowest positions).
		cb := wire.ChunkBlocks{Chunk: p.Hashes[c], Blocks: make([][]int64, len(p.R.Geometry)), Pos: uint32(c)}
		stores := false
		for gi, g := range p.R.Geometry {
			blocks := p.ChunkBlocks(PhaseStoreTable, gi, c)
			for l := range g.Layers {
				for k, b := range blocks {
					buf := make([]byte, g.PageBytes)
					p.Page(w.t, gi, l, c*p.BPC[gi]+k, buf)
					if _, err := w.stream.Upload(w.allocs[gi], p.PageOffset(gi, l, b), buf); err != nil {
						return nil, fmt.Errorf("rank %d: upload chunk %d group %d: %w", w.t, c, gi, err)
					}
					keep = append(keep, buf)
				}
			}
			if _, ok := p.R.StoreShard(gi, w.t); ok && w.stateKept(gi, c) {
				cb.Blocks[gi] = blocks
				stores = true
			} else {
				cb.Blocks[gi] = []int64{}
			}
		}
		if !stores {
			continue
		}
		ev, err := w.dev.NewEvent(true)
		if err != nil {
			return nil, fmt.Errorf("rank %d: new event: %w", w.t, err)
		}
		if err := w.stream.Record(ev); err != nil {
			_ = ev.Release()
			return nil, fmt.Errorf("rank %d: record: %w", w.t, err)
		}
		eh, err := w.dev.ExportEvent(ev)
		if err != nil {
			_ = ev.Release()
			return nil, fmt.Errorf("rank %d: export event: %w", w.t, err)
		}
		body, err := w.body(&wire.StoreRequest{RequestID: reqID, Namespace: p.R.Namespace, Session: w.session, Chunks: []wire.ChunkBlocks{cb}, Event: eh})
		if err != nil {
			_ = ev.Release()
			return nil, err
		}
		wg.Add(1)
		go func(c int) {
			defer wg.Done()
			// The event lives until the rankd answered: it may still be
			// waiting on it and reading the pages.
			defer ev.Release()
			// Subscribed before the request, so a BlocksFreed cannot be missed.
			freed, err := w.nc.SubscribeSync(w.subj.Freed(w.rank))
			if err != nil {
				mu.Lock()
				results = append(results, storeResult{chunk: c, err: err})
				mu.Unlock()
				return
			}
			defer freed.Unsubscribe()
			rep, err := bus.CallRetry[wire.StoreReply](ctx, w.nc, w.subj.Engine(w.rank, "store"), withDeadline(ctx, body), w.resend)
			r := storeResult{chunk: c, err: sessionErr(w, "store", err)}
			if err == nil {
				r.stored, r.deduped = rep.Stored, rep.Deduped
				if len(rep.Failed) > 0 {
					r.err = fmt.Errorf("store of chunk %d failed objects: %v", c, rep.Failed)
				}
				if rep.BlocksInUse {
					// C10: the blocks (and the event) stay untouched until freed.
					if ferr := waitFreed(ctx, freed, reqID, cb.Chunk); ferr != nil {
						r.err = errors.Join(r.err, ferr)
					}
				}
			}
			mu.Lock()
			results = append(results, r)
			mu.Unlock()
		}(c)
	}
	syncErr := w.stream.Synchronize(ctx)
	wg.Wait()
	keep = nil
	if syncErr != nil {
		return results, fmt.Errorf("rank %d: stream: %w", w.t, syncErr)
	}
	var errs []error
	for _, r := range results {
		if r.err != nil {
			errs = append(errs, fmt.Errorf("rank %d chunk %d: %w", w.t, r.chunk, r.err))
		}
	}
	return results, errors.Join(errs...)
}

// recompute writes the pages of the given chunks into the restore
// table's blocks, as the engine's own prefill would compute them.
func (w *worker) recompute(chunks []int) error {
	p := w.plan
	want := make(map[int]bool, len(chunks))
	for _, c := range chunks {
		want[c] = true
	}
	for gi, g := range p.R.Geometry {
		buf := make([]byte, g.PageBytes)
		for v, b := range p.Tables[PhaseRestoreTable][gi] {
			if !want[v/p.BPC[gi]] {
				continue
			}
			for l := range g.Layers {
				p.Page(w.t, gi, l, v, buf)
				if err := w.dev.Write(w.allocs[gi], p.PageOffset(gi, l, b), buf); err != nil {
					return fmt.Errorf("rank %d: recompute group %d: %w", w.t, gi, err)
				}
			}
		}
	}
	return nil
}

// wipe overwrites every declared page with the wipe pattern, as when the
// engine's prefix cache is reset; padding is left alone.
func (w *worker) wipe() error {
	p := w.plan
	for gi, g := range p.R.Geometry {
		buf := make([]byte, g.PageBytes)
		var err error
		p.eachPage(gi, func(off, n uint64) {
			if err == nil {
				err = w.wipePage(gi, off, buf)
			}
		})
		if err != nil {
			return fmt.Errorf("rank %d: wipe group %d: %w", w.t, gi, err)
		}
	}
	return nil
}

// wipePage writes the wipe pattern over the page of group gi at
// allocation offset off, through buf (a page's bytes).
func (w *worker) wipePage(gi int, off uint64, buf []byte) error {
	for i := range buf {
		buf[i] = WipeByte(off + uint64(i))
	}
	return w.dev.Write(w.allocs[gi], off, buf)
}

// retrieve sends the rank's part of a restore plan, with its target blocks.
func (w *worker) retrieve(ctx context.Context, restoreID string, items []wire.RetrieveItem) (*wire.RetrieveReply, error) {
	req := wire.RetrieveRequest{RestoreID: restoreID, Namespace: w.plan.R.Namespace, Session: w.session}
	for _, it := range items {
		it.Blocks = w.plan.ChunkBlocks(PhaseRestoreTable, it.Group, it.Chunk)
		req.Items = append(req.Items, it)
	}
	body, err := w.body(&req)
	if err != nil {
		return nil, err
	}
	rep, err := bus.CallRetry[wire.RetrieveReply](ctx, w.nc, w.subj.Engine(w.rank, "retrieve"), body, bus.NoResponders())
	return rep, sessionErr(w, "retrieve", err)
}

// verify reads back every allocation and compares it with what it must hold.
func (w *worker) verify(skip map[int]bool, left func(gi int) map[int]bool) (Mismatch, error) {
	total := Mismatch{Chunks: map[int]uint64{}}
	for gi := range w.plan.R.Geometry {
		var l map[int]bool
		if left != nil {
			l = left(gi)
		}
		m, err := w.plan.VerifyFrom(w.t, gi, PhaseRestoreTable, func(off uint64, dst []byte) error {
			return w.dev.Read(w.allocs[gi], off, dst)
		}, w.plan.AllocBytes(gi), skip, l)
		if err != nil {
			return total, fmt.Errorf("rank %d: read group %d: %w", w.t, gi, err)
		}
		total.Bytes += m.Bytes
		total.Outside += m.Outside
		for c, n := range m.Chunks {
			total.Chunks[c] += n
		}
		if total.First == "" {
			total.First = m.First
		}
	}
	return total, nil
}

// stateKept reports whether chunk c is stored with group gi's pages: not
// for a recurrent group's chunk between Config.StateEvery's (the engine
// kept no state at its end).
func (w *worker) stateKept(gi, c int) bool {
	k := w.stateEvery
	return k <= 0 || !statesMixed(w.plan.R.Groups) || w.plan.R.Groups[gi].Kind != dcp.Recurrent || (c+1)%k == 0
}
