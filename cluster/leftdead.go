package cluster

import (
	"reflect"
	"unsafe"

	"github.com/hashicorp/memberlist"
)

// memberlist calls NotifyLeave both when a member leaves gracefully and when
// it is declared dead, and the State field of the *Node it passes is never
// filled in (v0.7.0): memberlist keeps the real state in a State field of its
// private nodeState struct, which embeds Node and shadows Node.State
// (hashicorp/memberlist issues #266 and #293, open fix PR #321). Node.State
// is always StateAlive in that callback.
//
// The *Node memberlist passes is &nodeState.Node, the first field of the
// nodeState, and the callback runs with memberlist's node lock held, right
// after it wrote nodeState.State. So the true verdict is readable, race-free,
// at a fixed offset from the *Node. leftOrDead reads it there, with the offset
// found by reflection on memberlist's own types at init: if a memberlist
// upgrade changes that layout the read is switched off, every leave is then
// reported as a death (the safe direction: the owner fences), and
// TestGracefulLeaveIsLeft fails to say so.

// nodeStateOffset is the offset of nodeState.State from the start of the
// embedded Node, or -1 when memberlist's layout is not the one verified.
var nodeStateOffset = findNodeStateOffset()

func findNodeStateOffset() int {
	ml := reflect.TypeFor[memberlist.Memberlist]()
	f, ok := ml.FieldByName("nodeMap")
	if !ok || f.Type.Kind() != reflect.Map || f.Type.Elem().Kind() != reflect.Pointer {
		return -1
	}
	ns := f.Type.Elem().Elem() // memberlist.nodeState
	if ns.Kind() != reflect.Struct {
		return -1
	}
	node, ok := ns.FieldByName("Node")
	if !ok || !node.Anonymous || len(node.Index) != 1 || node.Offset != 0 ||
		node.Type != reflect.TypeFor[memberlist.Node]() {
		return -1
	}
	// FieldByName returns the shallowest State: nodeState's own, not the
	// promoted Node.State, when both exist.
	st, ok := ns.FieldByName("State")
	if !ok || len(st.Index) != 1 || st.Type != reflect.TypeFor[memberlist.NodeStateType]() ||
		st.Offset+st.Type.Size() > ns.Size() {
		return -1
	}
	return int(st.Offset)
}

// leftOrDead tells a graceful leave from a death for the node memberlist
// passed to NotifyLeave. It must only be called from NotifyLeave.
func leftOrDead(n *memberlist.Node) MemberState {
	// A fixed memberlist (PR #321) fills Node.State itself.
	switch n.State {
	case memberlist.StateLeft:
		return StateLeft
	case memberlist.StateDead:
		return StateDead
	}
	if nodeStateOffset < 0 {
		return StateDead
	}
	st := *(*memberlist.NodeStateType)(unsafe.Add(unsafe.Pointer(n), nodeStateOffset))
	if st == memberlist.StateLeft {
		return StateLeft
	}
	return StateDead
}
