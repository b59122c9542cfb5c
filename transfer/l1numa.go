package transfer

import (
	"errors"
	"fmt"

	"go.uber.org/zap"

	"github.com/kvtier/kvtier/internal/numa"
)

// L1Placement says where L1's pages are (Config.L1NUMA), as decided and
// checked at New.
type L1Placement struct {
	// Node is the NUMA node L1 is bound to; -1 when it is not bound.
	Node int
	// Why says why L1 is not bound ("" when it is).
	Why string
	// DeviceNode is the device's node as sysfs reports it; -1 unknown.
	DeviceNode int
	// Bytes is the size of L1.
	Bytes uint64
	// Sampled pages of bound L1 were looked up after allocation
	// (move_pages); Elsewhere of them were on another node (the bound
	// node was short of free memory), Absent not present at all.
	Sampled, Elsewhere, Absent int
}

// l1SamplePages is how many pages of bound L1 are looked up at New.
const l1SamplePages = 4096

// numaSys is the sysfs root the engine reads (tests point it at a fake).
var numaSys = numa.SysRoot

// L1Placement returns where L1's pages are.
func (e *Engine) L1Placement() L1Placement { return e.l1place }

// chooseL1Node decides L1's node for Config.L1NUMA and records the
// device's node; -1 and the reason when L1 is not to be bound.
func (e *Engine) chooseL1Node() (int, string, error) {
	devNode, devWhy := numa.DeviceNode(numaSys, e.dev.Info().PCIBus)
	e.l1place.Node, e.l1place.DeviceNode = -1, devNode
	hostNodes, err := numa.OnlineNodes(numaSys)
	if err != nil {
		if e.cfg.L1NUMA == numa.Auto {
			return -1, err.Error(), nil
		}
		hostNodes = nil // an explicit node is then refused, naming the error below
	}
	node, why, cerr := numa.Choose(e.cfg.L1NUMA, devNode, hostNodes)
	if cerr != nil {
		return -1, "", fmt.Errorf("transfer: L1 NUMA placement %s: %w", e.cfg.L1NUMA, errors.Join(cerr, err, ErrConfig))
	}
	if node < 0 && e.cfg.L1NUMA == numa.Auto && devNode < 0 {
		why += ": " + devWhy
	}
	return node, why, nil
}

// bindL1 binds m, fresh memory that nothing has touched, to node and
// faults it in there. A failure is an error when the node was given
// explicitly; under auto it is logged and m stays unbound (-1, why).
func (e *Engine) bindL1(m []byte, node int) (int, string, error) {
	err := numa.Bind(m, node)
	if err == nil {
		err = numa.Populate(m)
	}
	if err == nil {
		return node, "", nil
	}
	if e.cfg.L1NUMA != numa.Auto {
		return -1, "", fmt.Errorf("transfer: bind L1 of %d B to NUMA node %d: %w", len(m), node, errors.Join(err, ErrConfig))
	}
	e.log.Warn("L1: binding to the device's NUMA node failed; L1 stays where the kernel puts it",
		zap.Int("numa_node", node), zap.Error(err))
	return -1, "bind failed: " + err.Error(), nil
}

// allocL1 allocates private L1 of size bytes: pinned memory from the
// device, or, bound to a NUMA node, an anonymous mapping bound before its
// first touch, faulted in and then registered with the device.
func (e *Engine) allocL1(size uint64) error {
	node, why, err := e.chooseL1Node()
	if err != nil {
		return err
	}
	var m []byte
	if node >= 0 {
		if m, err = numa.Map(size); err != nil {
			return fmt.Errorf("transfer: allocate L1 of %d B: %w", size, errors.Join(err, ErrDevice))
		}
		if node, why, err = e.bindL1(m, node); err != nil || node < 0 {
			_ = numa.Unmap(m)
			m = nil
			if err != nil {
				return err
			}
		}
	}
	if m == nil {
		buf, err := e.dev.AllocHost(size)
		if err != nil {
			return fmt.Errorf("transfer: allocate L1 of %d B pinned host memory: %w", size, errors.Join(err, ErrDevice))
		}
		e.l1buf, e.l1mem = buf, buf.Bytes()
		e.noteL1Placement(nil, -1, why, size)
		return nil
	}
	buf, err := e.dev.RegisterHost(m, false)
	if err != nil {
		_ = numa.Unmap(m)
		return fmt.Errorf("transfer: register L1 of %d B on NUMA node %d with the device: %w", len(m), node, errors.Join(err, ErrDevice))
	}
	e.l1buf, e.l1mem, e.l1map = buf, m[:size], m
	e.noteL1Placement(m, node, "", size)
	return nil
}

// placeHostL1 binds the data region of a fresh host L1 segment to L1's
// node (its file's policy: the tmpfs pages are allocated there when
// faulted in, which bindL1 does).
func (e *Engine) placeHostL1(data []byte) error {
	node, why, err := e.chooseL1Node()
	if err != nil {
		return err
	}
	if node >= 0 {
		if node, why, err = e.bindL1(data, node); err != nil {
			return err
		}
	}
	if node < 0 {
		e.noteL1Placement(nil, -1, why, uint64(len(data)))
		return nil
	}
	e.noteL1Placement(data, node, "", uint64(len(data)))
	return nil
}

// noteL1Placement records and logs where L1 is: for bound L1 (m not nil),
// where a sample of its pages actually is.
func (e *Engine) noteL1Placement(m []byte, node int, why string, size uint64) {
	p := &e.l1place
	p.Node, p.Why, p.Bytes = node, why, size
	if m == nil {
		e.log.Info("L1 not bound to a NUMA node", zap.Uint64("l1_bytes", size), zap.String("l1_numa", e.cfg.L1NUMA.String()),
			zap.String("why", why))
		return
	}
	s, err := numa.Sample(m, l1SamplePages)
	if err != nil {
		e.log.Warn("L1: cannot check where its pages are", zap.Int("numa_node", node), zap.Error(err))
		return
	}
	p.Sampled, p.Elsewhere, p.Absent = s.Sampled, s.Elsewhere(node), s.Absent
	log := e.log.Info
	if p.Elsewhere > 0 || p.Absent > 0 {
		log = e.log.Warn // the node was short of memory: those pages cross the socket link
	}
	log("L1 on NUMA node", zap.Int("numa_node", node), zap.Uint64("l1_bytes", size), zap.Int("device_numa_node", p.DeviceNode),
		zap.Int("pages_sampled", p.Sampled), zap.Int("pages_elsewhere", p.Elsewhere), zap.Int("pages_absent", p.Absent))
}

// unmapL1 unmaps bound private L1, after its host buffer was released.
func (e *Engine) unmapL1() {
	if e.l1map != nil {
		if err := numa.Unmap(e.l1map); err != nil {
			e.log.Error("L1: unmap", zap.Error(err))
		}
		e.l1map = nil
	}
}
