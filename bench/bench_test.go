package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/cairn-sandbox/cairn/errdefs"
	"github.com/cairn-sandbox/cairn/internal/testenv"
)

// TestW1Smoke runs W1 with 2 iterations and the baselines, and checks that every
// correctness check passed, that every baseline ran and passed its state checks, and
// that the report has the keys later tools rely on. It asserts nothing about timings.
func TestW1Smoke(t *testing.T) {
	e := testenv.Engine(t)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	const n = 2
	var progress bytes.Buffer
	rep, err := Run(ctx, e, Options{Workload: "w1", Iterations: n, Baselines: true, Progress: &progress})
	t.Logf("progress:\n%s", progress.String())
	if err != nil {
		t.Fatalf("run: %v", err)
	}
	var out strings.Builder
	rep.Print(&out)
	t.Logf("report:\n%s", out.String())
	if rep.Correctness.Failed != 0 {
		t.Errorf("%d correctness checks failed: %v", rep.Correctness.Failed, rep.Correctness.Failures)
	}
	// 2 rollbacks, 2 forks ×1, 2 forks ×4, 2 forks ×16 and 2 warm forks ×16.
	if want := 2 + 2 + 8 + 32 + 32; rep.Correctness.Passed != want {
		t.Errorf("%d correctness checks passed, want %d", rep.Correctness.Passed, want)
	}
	checkJSONKeys(t, rep)
	// The test engine keeps W1's checkpoints resident: each reports how long it stopped
	// the processes, which is part of its call.
	if st := rep.CheckpointStoppedMS; st.N == 0 || st.Max > rep.CheckpointMS.Max {
		t.Errorf("checkpoint_stopped_ms %+v: want samples, none above the longest checkpoint (%v ms)", st, rep.CheckpointMS.Max)
	}
	for _, bl := range []struct {
		name    string
		missing func() string // a missing prerequisite, or ""
		checks  int           // rollbacks, and 16 per fork ×16
		forks   int
	}{
		{"runc_criu", missingRunc, n + 2*16, 2},
		{"runsc", missingRunsc, n + 2*16, 2},
		{"copytree", func() string { return "" }, n, 0},
	} {
		t.Run("baseline/"+bl.name, func(t *testing.T) {
			br := rep.Baselines[bl.name]
			if br == nil {
				t.Fatalf("baseline %s missing from the report", bl.name)
			}
			if br.Error != "" {
				if m := bl.missing(); m != "" {
					if os.Getenv("CI") == "true" {
						t.Fatalf("prerequisite missing in CI: %s", m)
					}
					t.Skipf("skipping: %s (%s)", m, br.Error)
				}
				t.Fatalf("baseline %s: %s", bl.name, br.Error)
			}
			if br.Checks != bl.checks {
				t.Errorf("%d state checks passed, want %d", br.Checks, bl.checks)
			}
			if br.CheckpointMS.N != n || br.RollbackMS.N != n || br.Fork16MS.N != bl.forks {
				t.Errorf("samples: %d checkpoints, %d rollbacks, %d forks ×16; want %d, %d, %d",
					br.CheckpointMS.N, br.RollbackMS.N, br.Fork16MS.N, n, n, bl.forks)
			}
			if br.StorageRatio <= 0 || br.ImageBytesPerCheckpoint.P50 <= 0 {
				t.Errorf("storage ratio %v, image bytes p50 %v: want both above 0", br.StorageRatio, br.ImageBytesPerCheckpoint.P50)
			}
			if bl.forks == 0 && br.NotMeasured == "" {
				t.Error("fork16_ms left zero without saying so in not_measured")
			}
		})
	}
}

func missingRunc() string {
	if _, err := os.Stat(runcPath); err != nil {
		return "runc not installed at " + runcPath
	}
	return ""
}

func missingRunsc() string {
	if _, err := findRunsc(); err != nil {
		return err.Error()
	}
	return ""
}

func checkJSONKeys(t *testing.T, rep *Report) {
	b, err := json.Marshal(rep)
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	hasKeys := func(where string, obj map[string]any, extra ...string) {
		for _, k := range []string{"checkpoint_ms", "rollback_ms", "fork16_ms"} {
			s, ok := obj[k].(map[string]any)
			if !ok {
				t.Errorf("%s%s missing from the report JSON", where, k)
				continue
			}
			for _, p := range []string{"p50", "p95", "p99"} {
				if _, ok := s[p].(float64); !ok {
					t.Errorf("%s%s.%s missing from the report JSON", where, k, p)
				}
			}
		}
		for _, k := range append([]string{"storage_ratio"}, extra...) {
			if _, ok := obj[k].(float64); !ok {
				t.Errorf("%s%s missing from the report JSON", where, k)
			}
		}
	}
	hasKeys("", m, "background_ms_per_checkpoint")
	bls, _ := m["baselines"].(map[string]any)
	for _, name := range []string{"runc_criu", "runsc", "copytree"} {
		bl, ok := bls[name].(map[string]any)
		if !ok {
			t.Errorf("baselines.%s missing from the report JSON", name)
			continue
		}
		hasKeys("baselines."+name+".", bl, "checks_passed")
	}
	ratios, _ := m["ratios"].(map[string]any)
	for name, r := range ratios {
		if _, ok := r.(map[string]any)["fork16"]; !ok {
			t.Errorf("ratios.%s.fork16 missing from the report JSON", name)
		}
	}
}

func TestRejectsOtherWorkloads(t *testing.T) {
	_, err := Run(context.Background(), nil, Options{Workload: "w9"})
	if errdefs.Code(err) != "invalid_argument" {
		t.Fatalf("Run(w9) = %v, want an invalid_argument error", err)
	}
}

// TestWarmMemory writes once to 512 MiB of free memory and checks the warm-up measured
// and counted it, and that without --warm-memory only the first chunk is measured.
func TestWarmMemory(t *testing.T) {
	w, err := warmMemory(nil, true, 512<<20)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%+v", *w)
	if w.Skipped == "" && (w.WarmedBytes != 512<<20 || w.WarmGiBps <= 0) {
		t.Fatalf("warmed %d bytes at %.2f GiB/s, want 512 MiB", w.WarmedBytes, w.WarmGiBps)
	}
	if w.FirstTouchGiBps <= 0 {
		t.Fatalf("first touch not measured: %+v", *w)
	}
	w, err = warmMemory(nil, false, 0)
	if err != nil {
		t.Fatal(err)
	}
	if w.Skipped == "" || w.WarmedBytes != 0 || w.FirstTouchGiBps <= 0 {
		t.Fatalf("without warming: %+v; want the first chunk measured and nothing warmed", *w)
	}
}

// TestMachineMemoryFacts checks the facts that explain a run's memory costs are read.
func TestMachineMemoryFacts(t *testing.T) {
	m := machineInfo()
	t.Logf("cpu %q, thp %q, page fault %.2f µs", m.CPUModel, m.THP, m.PageFaultUS)
	if m.PageFaultUS <= 0 || m.THP == "" || m.CPUModel == "" {
		t.Fatalf("machine facts missing: cpu %q, thp %q, page fault %.2f µs", m.CPUModel, m.THP, m.PageFaultUS)
	}
}

// TestW2Smoke runs a short W2 (10 expansions, 4 after a rollback; the workload's are
// 100 and 49) and checks that every rollback's state was right and that the report
// holds a sample for every step, checkpoint and rollback, with the steps' REPL
// statements, and says of every rollback whether it was rewound. No timing is asserted.
func TestW2Smoke(t *testing.T) {
	e := testenv.Engine(t)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	defer func(n int) { w2Expansions = n }(w2Expansions)
	w2Expansions = 10
	rep, err := Run(ctx, e, Options{Workload: "w2", Iterations: 2})
	if err != nil {
		t.Fatalf("run: %v", err)
	}
	var out strings.Builder
	rep.Print(&out)
	t.Logf("report:\n%s", out.String())
	x := rep.W2
	if x == nil {
		t.Fatal("no W2 in the report")
	}
	if rep.Correctness.Failed != 0 || rep.Correctness.Passed != 4 {
		t.Errorf("correctness: %d passed, %d failed (%v); want 4 passed", rep.Correctness.Passed, rep.Correctness.Failed, rep.Correctness.Failures)
	}
	if x.Expansions != 10 || x.Rollbacks != 4 {
		t.Errorf("%d expansions, %d rollbacks; want 10 and 4", x.Expansions, x.Rollbacks)
	}
	for name, s := range map[string]Stats{"step_ms": x.StepMS, "repl_ms": x.REPLMS, "floor_step_ms": x.FloorStepMS,
		"floor_repl_ms": x.FloorREPLMS, "checkpoint_ms": x.CheckpointMS, "rollback_ms": x.RollbackMS} {
		want := 10
		switch name {
		case "checkpoint_ms":
			want = 11 // the root's, then one per expansion
		case "rollback_ms":
			want = 4
		}
		if s.N != want || s.Min <= 0 {
			t.Errorf("%s: %d samples (min %v), want %d, each above 0", name, s.N, s.Min, want)
		}
	}
	if x.RollbackSteps.N != 4 || x.RollbackSteps.Min < 1 {
		t.Errorf("rollback_steps: %d samples (min %v), want 4, each at least one step", x.RollbackSteps.N, x.RollbackSteps.Min)
	}
	if x.REPLMS.Mean >= x.StepMS.Mean {
		t.Errorf("the REPL statement (mean %v ms) is not part of the step (mean %v ms)", x.REPLMS.Mean, x.StepMS.Mean)
	}
	if x.RollbacksRewound+x.RewindsRefused != 4 || x.RewindsRefusedForCopy > x.RewindsRefused {
		t.Errorf("rollbacks rewound %d, refused %d (%d for the copy): want 4 in all", x.RollbacksRewound, x.RewindsRefused, x.RewindsRefusedForCopy)
	}
	if x.FloorS <= 0 || x.TotalS <= 0 {
		t.Errorf("floor %v s, search %v s: want both above 0", x.FloorS, x.TotalS)
	}
}

// TestDistance: the steps between two nodes of a search tree go up to their common
// ancestor and down again.
func TestDistance(t *testing.T) {
	root := &node{ck: "root"}
	a := &node{ck: "a", parent: root}
	a1 := &node{ck: "a1", parent: a}
	a2 := &node{ck: "a2", parent: a1}
	b := &node{ck: "b", parent: root}
	for _, tc := range []struct {
		x, y *node
		want int
	}{{a2, a2, 0}, {a2, a1, 1}, {a1, a2, 1}, {a2, root, 3}, {a2, b, 4}, {b, a1, 3}, {a2, &node{ck: "elsewhere"}, -1}} {
		if got := distance(tc.x, tc.y); got != tc.want {
			t.Errorf("distance(%s, %s) = %d, want %d", tc.x.ck, tc.y.ck, got, tc.want)
		}
	}
}

// TestUCT: the selection descends from the root by UCB1 to the first node with room for
// a child, passes through the sandbox's own node without choosing it, and tries the
// next best child where the best one's subtree holds nothing else.
func TestUCT(t *testing.T) {
	mk := func(ck string, parent *node, visits int, value float64) *node {
		n := &node{ck: ck, parent: parent, visits: visits, value: value}
		if parent != nil {
			parent.children = append(parent.children, n)
		}
		return n
	}
	root := mk("root", nil, 10, 5)
	a := mk("a", root, 4, 3.6) // mean 0.9: the best child
	mk("b", root, 3, 0.3)
	mk("c", root, 2, 0.2)
	a1 := mk("a1", a, 1, 0.9)
	mk("a2", a, 1, 0.1)
	a3 := mk("a3", a, 1, 0.5)
	for _, tc := range []struct {
		skip *node
		want *node
	}{
		{nil, a1},  // root and a are full; a1 is a's best child, a leaf
		{a1, a3},   // a1 is the sandbox's node: a's next best
		{a, a1},    // a is descended through
		{root, a1}, // and so is the root
	} {
		if got := uct(root, tc.skip); got != tc.want {
			t.Errorf("uct(skip %v) = %v, want %s", tc.skip, got, tc.want.ck)
		}
	}
	// A leaf alone under a full node: its subtree offers nothing but skip.
	lone := mk("lone", nil, 1, 1)
	if got := uct(lone, lone); got != nil {
		t.Errorf("uct of a lone skipped leaf = %s, want nil", got.ck)
	}
}

// TestUCTSearchShape replays W2's search offline (its 100 expansions, every other one
// after a rollback, random rewards) and checks the tree it grows: no node with more
// than w2Branching children, never a rollback to the node the sandbox is at. It logs
// how far the rollbacks go.
func TestUCTSearchShape(t *testing.T) {
	for seed := int64(1); seed <= 20; seed++ {
		rng := rand.New(rand.NewPCG(uint64(seed), 0))
		root := &node{ck: "0"}
		cur, all, maxSteps, sum, n := root, []*node{root}, 0, 0, 0
		for i := 0; i < w2Expansions; i++ {
			if i%2 == 1 && i < w2Expansions-2 {
				target := uct(root, cur)
				if target == nil || target == cur {
					t.Fatalf("seed %d, expansion %d: uct chose %v, the sandbox's node %s", seed, i, target, cur.ck)
				}
				d := distance(cur, target)
				maxSteps, sum, n = max(maxSteps, d), sum+d, n+1
				cur = target
			}
			child := &node{ck: fmt.Sprint(i + 1), parent: cur}
			cur.children = append(cur.children, child)
			all = append(all, child)
			reward := rng.Float64()
			for x := child; x != nil; x = x.parent {
				x.visits++
				x.value += reward
			}
			cur = child
		}
		for _, x := range all {
			if len(x.children) > w2Branching {
				t.Fatalf("seed %d: node %s has %d children, more than %d", seed, x.ck, len(x.children), w2Branching)
			}
		}
		t.Logf("seed %d: %d rollbacks, %.1f steps on average, %d at most", seed, n, float64(sum)/float64(n), maxSteps)
	}
}
