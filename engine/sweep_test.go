package engine_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/cairn-sandbox/cairn/engine"
	"github.com/cairn-sandbox/cairn/internal/testenv"
)

// TestGCBesideAnotherEngine runs one engine's GC over and over while another engine on
// the same data directory (cairnd and a CLI, say) checkpoints a sandbox, with and
// without resident checkpoints (with standbys prepared for the CRIU ones). Nothing
// the second engine makes may be collected: every checkpoint keeps its filesystem and
// gives back its REPL state on rollback. The sweep used to read the rows before listing
// the directories, and removed what was recorded in between (conformance ResidentPaths:
// "snapshot source checkpoints/<id>/fs: no such volume").
func TestGCBesideAnotherEngine(t *testing.T) {
	for _, tc := range []struct {
		name      string
		configure func(*engine.Config)
	}{
		{"resident", nil},
		{"criu", func(c *engine.Config) { c.Residents = -1 }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := testenv.EngineWith(t, tc.configure)
			ctx := context.Background()
			sb, r := newREPL(t, e, true)
			other, err := engine.Open(ctx, testenv.Config(t))
			if err != nil {
				t.Fatal(err)
			}
			defer other.Close()

			var (
				wg      sync.WaitGroup
				mu      sync.Mutex
				removed []string
				gcs     int
			)
			stop := make(chan struct{})
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					select {
					case <-stop:
						return
					default:
					}
					rep, err := other.GC(ctx)
					mu.Lock()
					gcs++
					if err != nil {
						removed = append(removed, "error: "+err.Error())
					} else {
						removed = append(removed, rep.Checkpoints...)
						removed = append(removed, rep.Volumes...)
					}
					mu.Unlock()
				}
			}()
			const steps = 25
			ids := make([]string, steps)
			for i := range steps {
				r.ask(fmt.Sprintf("x = %d", i))
				ck, err := e.Checkpoint(ctx, sb.ID, engine.CheckpointOptions{})
				if err != nil {
					close(stop)
					wg.Wait()
					t.Fatalf("checkpoint %d: %v", i, err)
				}
				ids[i] = ck.ID
			}
			close(stop)
			wg.Wait()
			e.Quiesce()
			t.Logf("%d GCs beside %d checkpoints", gcs, steps)

			// Whatever the GCs removed, none of it may be this sandbox's.
			var ours []string
			for _, name := range removed {
				for _, id := range append(ids, sb.ID) {
					if strings.Contains(name, id) {
						ours = append(ours, name)
					}
				}
				if strings.HasPrefix(name, "error: ") {
					ours = append(ours, name)
				}
			}
			if len(ours) > 0 {
				t.Errorf("the other engine's GC removed this sandbox's %v", ours)
			}
			for i, id := range ids {
				if err := e.Rollback(ctx, sb.ID, id); err != nil {
					t.Fatalf("rollback to checkpoint %d (%s): %v", i, id, err)
				}
				if got, want := r.ask("print(x)"), fmt.Sprint(i); got != want {
					t.Fatalf("REPL after rollback to checkpoint %d: %q, want %q", i, got, want)
				}
			}
		})
	}
}
