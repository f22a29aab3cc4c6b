package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/cairn-sandbox/cairn/errdefs"
	"github.com/cairn-sandbox/cairn/internal/testenv"
)

// TestW1Smoke runs W1 with 3 iterations and the baselines, and checks that every
// correctness check passed and that the report has the keys later tools rely on. It
// asserts nothing about timings.
func TestW1Smoke(t *testing.T) {
	e := testenv.Engine(t)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	var progress bytes.Buffer
	rep, err := Run(ctx, e, Options{Workload: "w1", Iterations: 3, Baselines: true, Progress: &progress})
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
	// 3 rollbacks + forks ×1 (3), ×4 (2×4), ×16 (2×16).
	// 3 rollbacks, 3 forks ×1, 2 forks ×4, 2 forks ×16 and 2 warm forks ×16.
	if want := 3 + 3 + 8 + 32 + 32; rep.Correctness.Passed != want {
		t.Errorf("%d correctness checks passed, want %d", rep.Correctness.Passed, want)
	}
	for name, bl := range rep.Baselines {
		if bl.Error != "" {
			t.Errorf("baseline %s: %s", name, bl.Error)
		} else if bl.Checks != 3 {
			t.Errorf("baseline %s: %d state checks passed, want 3", name, bl.Checks)
		}
	}
	checkJSONKeys(t, rep)
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
	hasPercentiles := func(where string, v any) {
		s, ok := v.(map[string]any)
		if !ok {
			t.Errorf("%s missing from the report JSON", where)
			return
		}
		for _, k := range []string{"p50", "p95", "p99"} {
			if _, ok := s[k]; !ok {
				t.Errorf("%s.%s missing from the report JSON", where, k)
			}
		}
	}
	for _, k := range []string{"checkpoint_ms", "rollback_ms", "fork16_ms"} {
		hasPercentiles(k, m[k])
	}
	if _, ok := m["storage_ratio"]; !ok {
		t.Error("storage_ratio missing from the report JSON")
	}
	bls, _ := m["baselines"].(map[string]any)
	for _, name := range []string{"runc_btrfs", "copytree"} {
		bl, _ := bls[name].(map[string]any)
		hasPercentiles("baselines."+name+".checkpoint_ms", bl["checkpoint_ms"])
		hasPercentiles("baselines."+name+".rollback_ms", bl["rollback_ms"])
	}
}

func TestRejectsOtherWorkloads(t *testing.T) {
	_, err := Run(context.Background(), nil, Options{Workload: "w9"})
	if errdefs.Code(err) != "invalid_argument" {
		t.Fatalf("Run(w9) = %v, want an invalid_argument error", err)
	}
}
