package bench

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/cairn-sandbox/cairn/engine"
	"github.com/cairn-sandbox/cairn/errdefs"
)

// W2 — tree search replay (MCTS-shaped) — and W3 — RL fan-out — of REFERENCE.md, both
// on W1's sandbox state.

// W2Report is the result of W2: 100 expansions, 49 of them starting with a rollback to a
// node chosen by UCT over a random reward, each followed by a step and a checkpoint;
// against the floor of the same 100 steps with no snapshotting at all.
type W2Report struct {
	Expansions   int     `json:"expansions"`
	Rollbacks    int     `json:"rollbacks"`
	TotalS       float64 `json:"total_s"`
	FloorS       float64 `json:"floor_s"`
	OverheadPct  float64 `json:"overhead_pct"`
	CheckpointMS Stats   `json:"checkpoint_ms"`
	RollbackMS   Stats   `json:"rollback_ms"`
	// RollbackSteps is how far each rollback went in the tree: the steps from the node
	// rolled back from, up to the two nodes' common ancestor and down to the target
	// (what its revert and copy must undo and redo).
	RollbackSteps Stats `json:"rollback_steps"`
	// FloorStepMS and StepMS time the steps alone, without snapshots (the floor) and in
	// the search: what the search's total holds beyond its checkpoints and rollbacks is
	// the steps' slowdown (the faults of their first writes to pages the zygotes share,
	// the background work beside them).
	FloorStepMS Stats `json:"floor_step_ms"`
	StepMS      Stats `json:"step_ms"`
	// FloorREPLMS and REPLMS are the same for the REPL's statement alone (the step's
	// writes to memory: ~2 MB, of pages the zygotes share).
	FloorREPLMS Stats `json:"floor_repl_ms"`
	REPLMS      Stats `json:"repl_ms"`
	// CheckpointPhasesP50MS and RollbackPhasesP50MS are as in BackendReport.
	CheckpointPhasesP50MS map[string]float64 `json:"checkpoint_phases_p50_ms"`
	RollbackPhasesP50MS   map[string]float64 `json:"rollback_phases_p50_ms"`
	// RollbacksRewound and RewindsRefused are as in BackendReport.
	RollbacksRewound      int `json:"rollbacks_rewound"`
	RewindsRefused        int `json:"rewinds_refused"`
	RewindsRefusedForCopy int `json:"rewinds_refused_for_copy"`
	// Standby counts the engine's standby work during the search.
	Standby engine.Stats `json:"standby"`
}

// W3Report is the result of W3: 16 sandboxes forked from one warm checkpoint, reset to
// it and stepped, Rounds times.
type W3Report struct {
	Sandboxes int     `json:"sandboxes"`
	Rounds    int     `json:"rounds"`
	ResetMS   Stats   `json:"reset_ms"`
	ResetsPS  float64 `json:"resets_per_s"`
	// RoundS is the wall time of one round (16 resets and 16 steps).
	RoundS  Stats        `json:"round_s"`
	Standby engine.Stats `json:"standby"`
}

func statsDelta(a, b engine.Stats) engine.Stats { return b.Since(a) }

// node is a search-tree node: a checkpoint with UCT statistics.
type node struct {
	ck       string
	parent   *node
	children []*node
	visits   int
	value    float64
}

// w2Branching is the search's branching factor: a node with fewer children is expanded
// when the selection reaches it, one with as many is descended through.
const w2Branching = 3

// uctExplore is UCB1's exploration constant (√2, rounded as usual).
const uctExplore = 1.4

// ucb1 is the score of child n of a node visited parentVisits times: its mean reward
// plus the exploration bonus. Every node has been visited (a new one backs its reward
// up at once).
func ucb1(n *node, parentVisits int) float64 {
	return n.value/float64(n.visits) + uctExplore*math.Sqrt(math.Log(float64(parentVisits))/float64(n.visits))
}

// uct is UCT's selection: from the root, it descends to the child of highest UCB1
// score until it reaches a node with fewer than w2Branching children, which is the one
// to expand. skip (the node the sandbox is at: an expansion after a rollback starts
// elsewhere) is descended through but never chosen; where the best child's subtree
// offers no other node, the next best is tried. It returns nil only if n's subtree
// holds no node but skip.
//
// (Before 2026-12-06 W2 picked the best-scoring node of the whole tree, which with one
// visit per leaf made the search alternate between two ever deeper branches: the k-th
// rollback went 2k-1 steps, not a tree search's few.)
func uct(n *node, skip *node) *node {
	if n != skip && len(n.children) < w2Branching {
		return n
	}
	kids := slices.Clone(n.children)
	slices.SortStableFunc(kids, func(a, b *node) int { return cmp.Compare(ucb1(b, n.visits), ucb1(a, n.visits)) })
	for _, c := range kids {
		if got := uct(c, skip); got != nil {
			return got
		}
	}
	return nil
}

// distance is the number of steps between two nodes of the tree.
func distance(a, b *node) int {
	depth := map[*node]int{}
	for n, d := a, 0; n != nil; n, d = n.parent, d+1 {
		depth[n] = d
	}
	for n, d := b, 0; n != nil; n, d = n.parent, d+1 {
		if da, ok := depth[n]; ok {
			return da + d
		}
	}
	return -1 // not in one tree
}

// w2Expansions is W2's number of expansions (REFERENCE.md: 100, 49 of them after a
// rollback); a test makes fewer.
var w2Expansions = 100

// runW2 measures the floor, then the search, each on a fresh W1 sandbox.
func (b *runner) runW2(ctx context.Context) (*W2Report, error) {
	expansions := w2Expansions
	rep := &W2Report{Expansions: expansions}
	b.settle(ctx)
	b.phase("W2 floor: %d steps without snapshots", expansions)
	floor, err := setupW1(ctx, b.e, b.iso)
	// Removed before the search (and on any failure before it): its last steps' data,
	// not yet written back (btrfs commits every 30 s), would hold a data reservation of
	// the pool's filesystem (~17 MB), which makes every root look changed to a planned
	// revert (storage/btrfs/plan.go): one run planned none of its 49 reverts.
	removeFloor := func(ctx context.Context) error {
		if floor == nil {
			return nil
		}
		id := floor.id
		floor = nil
		return b.e.Remove(ctx, id)
	}
	defer removeFloor(context.WithoutCancel(ctx))
	if err != nil {
		return nil, err
	}
	start := time.Now()
	var floorMS, floorREPL []float64
	for i := 0; i < expansions; i++ {
		t := time.Now()
		if err := floor.step(ctx); err != nil {
			return nil, err
		}
		floorMS = append(floorMS, ms(time.Since(t)))
		floorREPL = append(floorREPL, floor.replMS)
	}
	rep.FloorS = time.Since(start).Seconds()
	rep.FloorStepMS, rep.FloorREPLMS = summarize(floorMS), summarize(floorREPL)
	if err := removeFloor(ctx); err != nil {
		return nil, fmt.Errorf("remove the floor's sandbox: %w", err)
	}

	b.settle(ctx)
	b.phase("W2 search: %d expansions, %d of them after a rollback", expansions, (expansions-2)/2)
	b.w, err = setupW1(ctx, b.e, b.iso)
	if b.w != nil {
		defer b.cleanup(context.WithoutCancel(ctx))
	}
	if err != nil {
		return nil, err
	}
	ckPhases, rbPhases := map[string][]float64{}, map[string][]float64{}
	b.w.ckPhases = ckPhases
	before := b.e.Stats()
	var elapsed time.Duration
	var ckMS, rbMS, stepMS, replMS, steps []float64
	ck0, d, err := b.w.checkpoint(ctx)
	if err != nil {
		return nil, err
	}
	elapsed += d
	ckMS = append(ckMS, ms(d))
	root := &node{ck: ck0.ID}
	cur := root
	for i := 0; i < expansions; i++ {
		t := time.Now()
		if i%2 == 1 && i < expansions-2 { // 49 rollbacks of 100
			target := uct(root, cur)
			steps = append(steps, float64(distance(cur, target)))
			rb := time.Now()
			if err := traced(ctx, "rollback to "+target.ck, rbPhases, func(ctx context.Context) error { return b.e.Rollback(ctx, b.w.id, target.ck) }); err != nil {
				return nil, fmt.Errorf("w2 rollback: %w", err)
			}
			rbMS = append(rbMS, ms(time.Since(rb)))
			rep.Rollbacks++
			cur = target
			elapsed += time.Since(t)
			// Correctness is checked off the clock.
			b.rep.Correctness.add(fmt.Sprintf("w2 rollback %d", i), b.w.check(ctx, b.w.id, b.w.repl, b.w.expect[target.ck]))
			t = time.Now()
		}
		if err := b.w.step(ctx); err != nil {
			return nil, err
		}
		stepMS = append(stepMS, ms(time.Since(t)))
		replMS = append(replMS, b.w.replMS)
		elapsed += time.Since(t)
		ck, d, err := b.w.checkpoint(ctx) // records the expected state off the clock
		if err != nil {
			return nil, err
		}
		elapsed += d
		ckMS = append(ckMS, ms(d))
		child := &node{ck: ck.ID, parent: cur}
		cur.children = append(cur.children, child)
		reward := b.rng.Float64()
		for n := child; n != nil; n = n.parent {
			n.visits++
			n.value += reward
		}
		cur = child
	}
	rep.TotalS = elapsed.Seconds()
	rep.OverheadPct = 100 * (rep.TotalS - rep.FloorS) / rep.FloorS
	rep.CheckpointMS, rep.RollbackMS, rep.StepMS = summarize(ckMS), summarize(rbMS), summarize(stepMS)
	rep.REPLMS, rep.RollbackSteps = summarize(replMS), summarize(steps)
	rep.CheckpointPhasesP50MS, rep.RollbackPhasesP50MS = p50s(ckPhases), p50s(rbPhases)
	rep.RollbacksRewound, rep.RewindsRefused = len(rbPhases["rewound"]), len(rbPhases["rewind_refused"])
	rep.RewindsRefusedForCopy = len(rbPhases["rewind_refused_copy"])
	rep.Standby = statsDelta(before, b.e.Stats())
	return rep, nil
}

// runW3 forks 16 sandboxes from one warm checkpoint and resets them to it, rounds times.
func (b *runner) runW3(ctx context.Context, rounds int) (*W3Report, error) {
	const fan = 16
	rep := &W3Report{Sandboxes: fan, Rounds: rounds}
	b.settle(ctx)
	var err error
	b.w, err = setupW1(ctx, b.e, b.iso)
	if b.w != nil {
		defer b.cleanup(context.WithoutCancel(ctx))
	}
	if err != nil {
		return nil, err
	}
	warm, _, err := b.w.checkpoint(ctx)
	if err != nil {
		return nil, err
	}
	b.phase("W3: prewarming %d standbys of the warm checkpoint, forking %d", fan, fan)
	if err := b.e.Prewarm(ctx, warm.ID, fan); errors.Is(err, errdefs.ErrFailedPrecondition) {
		b.phase("W3 without standbys: %v", err) // gvisor: every reset restores
	} else if err != nil {
		return nil, err
	}
	forks, err := b.e.Fork(ctx, warm.ID, fan)
	if err != nil {
		return nil, err
	}
	defer func() {
		for _, f := range forks {
			b.e.Remove(context.WithoutCancel(ctx), f.ID)
		}
	}()
	before := b.e.Stats()
	var resets, roundS []float64
	b.phase("W3: %d rounds of %d resets and %d steps", rounds, fan, fan)
	for r := 0; r < rounds; r++ {
		start := time.Now()
		for _, f := range forks {
			t := time.Now()
			if err := b.e.Rollback(ctx, f.ID, warm.ID); err != nil {
				return nil, fmt.Errorf("w3 reset of %s: %w", f.ID, err)
			}
			resets = append(resets, ms(time.Since(t)))
		}
		if r == rounds-1 {
			for _, f := range forks {
				b.rep.Correctness.add("w3 reset of "+f.ID, b.w.check(ctx, f.ID, nil, b.w.expect[warm.ID]))
			}
		}
		for _, f := range forks {
			fw := *b.w
			fw.id = f.ID
			fw.repl = &repl{t: engineTransport{b.e, f.ID, b.w.py}, off: b.w.expect[warm.ID].StdoutOff}
			if err := fw.step(ctx); err != nil {
				return nil, fmt.Errorf("w3 step in %s: %w", f.ID, err)
			}
		}
		roundS = append(roundS, time.Since(start).Seconds())
	}
	rep.ResetMS, rep.RoundS = summarize(resets), summarize(roundS)
	var total float64
	for _, v := range resets {
		total += v
	}
	if total > 0 {
		rep.ResetsPS = float64(len(resets)) / (total / 1000)
	}
	rep.Standby = statsDelta(before, b.e.Stats())
	return rep, nil
}
