package index

import "slices"

// refList is a rank's chunk list (rankState.chunks) in blocks: an append
// writes into the last block's spare room or starts a new block, so it
// never copies the list. As one slice, each growth copied all of it on the
// committer (1.1-1.5 s of growslice in a 1 M-object resync's profile on the
// 2-core VM; Go grows large slices by a quarter, so a list of millions was
// copied every few hundred thousand appends).
//
// Entries once appended are never written again (a compaction builds a
// new list), so a view (view: the block headers copied, and n) taken by a
// sliced inventory or handed to a compaction's goroutine keeps reading
// the same entries while the committer appends to the list. A plain copy
// of a refList is not a view: appends rewrite the last block's header.
type refList struct {
	blocks [][]chunkRef
	n      int
}

// refBlock is the size of the blocks appends start (32 B entries: 1 MiB).
const refBlock = 1 << 15

// fromRefs makes a list of s, whose spare capacity takes the next appends.
func fromRefs(s []chunkRef) refList {
	if len(s) == 0 {
		return refList{}
	}
	return refList{blocks: [][]chunkRef{s}, n: len(s)}
}

func (l *refList) len() int { return l.n }

// view returns a view of the entries so far: O(blocks).
func (l *refList) view() refList {
	return refList{blocks: slices.Clone(l.blocks), n: l.n}
}

func (l *refList) add(ref chunkRef) {
	k := len(l.blocks)
	if k == 0 || len(l.blocks[k-1]) == cap(l.blocks[k-1]) {
		l.blocks = append(l.blocks, make([]chunkRef, 0, refBlock))
		k++
	}
	l.blocks[k-1] = append(l.blocks[k-1], ref)
	l.n++
}

// segments returns the entries [from, to) as consecutive slices of the
// blocks (not copies: do not modify them).
func (l *refList) segments(from, to int) [][]chunkRef {
	var out [][]chunkRef
	off := 0
	for _, b := range l.blocks {
		if off >= to {
			break
		}
		lo, hi := max(from-off, 0), min(to-off, len(b))
		if lo < hi {
			out = append(out, b[lo:hi])
		}
		off += len(b)
	}
	return out
}

// all iterates over every entry of the view.
func (l *refList) all(yield func(chunkRef) bool) {
	for _, seg := range l.segments(0, l.n) {
		for _, ref := range seg {
			if !yield(ref) {
				return
			}
		}
	}
}

// flat copies the entries [0, n) into one slice.
func (l *refList) flat() []chunkRef {
	out := make([]chunkRef, 0, l.n)
	for _, seg := range l.segments(0, l.n) {
		out = append(out, seg...)
	}
	return out
}
