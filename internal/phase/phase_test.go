package phase

import (
	"context"
	"testing"
	"time"
)

func TestPhases(t *testing.T) {
	Since(context.Background(), "untraced", time.Now()) // no recorder: nothing happens
	if Of(context.Background()) != nil {
		t.Fatal("a bare context has a recorder")
	}
	got := map[string]time.Duration{}
	ctx := With(context.Background(), func(name string, d time.Duration) { got[name] += d })
	start := time.Now().Add(-time.Millisecond)
	Since(ctx, "a", start)
	Since(ctx, "a", start)
	Of(ctx)("b", 3*time.Millisecond)
	if got["a"] < 2*time.Millisecond || got["b"] != 3*time.Millisecond || len(got) != 2 {
		t.Fatalf("recorded %v; want a >= 2ms (twice 1ms) and b = 3ms", got)
	}
}
