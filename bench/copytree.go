package bench

import (
	"context"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"time"

	"github.com/cairn-sandbox/cairn/engine"
	"github.com/cairn-sandbox/cairn/internal/initctl"
	"github.com/cairn-sandbox/cairn/isolation"
	"github.com/cairn-sandbox/cairn/isolation/container"
)

// copytreeCheckpoint is one baseline checkpoint: a full copy of the root and its images.
type copytreeCheckpoint struct {
	root, images string
	want         expected
}

// fileTransport reaches the W1 REPL inside a sandbox run by the container backend
// directly (outside the engine): stdin through the backend, stdout from its file.
type fileTransport struct {
	b      *container.Backend
	sb     *isolation.Sandbox
	handle string
}

func (t fileTransport) write(ctx context.Context, data []byte) error {
	return t.b.WriteStdin(ctx, t.sb, t.handle, data, false)
}

func (t fileTransport) output(ctx context.Context, off int64) ([]byte, int64, error) {
	f, err := os.Open(initctl.ProcPath(filepath.Join(t.sb.Root, initctl.Dir), t.handle, "stdout"))
	if err != nil {
		return nil, off, err
	}
	defer f.Close()
	b := make([]byte, 1<<20)
	n, _ := f.ReadAt(b, off)
	return b[:n], off + int64(n), nil
}

// copytreeBaseline measures DeltaBox's "copytree" baseline on the W1 sandbox itself,
// through cairn's own container backend: checkpoint = freeze, `cp -a --reflink=never`
// of the root, CRIU dump (leave running), thaw; rollback = a `cp -a` of the saved copy
// (the copy must survive for later rollbacks) and a CRIU restore onto it. Storage is
// measured as cairn's (the copies and images are in the pool). Fork ×16 is not: it
// would be 16 full copies of the root (~6 GB written) per repetition.
func (b *runner) copytreeBaseline(ctx context.Context, s *scratch, n int, br *BaselineReport) error {
	br.Method = "freeze + `cp -a --reflink=never` of the root + CRIU dump (leave running) + thaw, with cairn's container backend; rollback: `cp -a` of the saved copy + CRIU restore"
	br.NotMeasured = "fork16_ms: each fork is a full copy of the root (~400 MB), 16 per repetition; too costly to run alongside the others"
	// The dumps below are CRIU's of the whole tree: cairn's zygotes must not be in it.
	if err := b.e.Settle(ctx, b.w.id); err != nil {
		return err
	}
	sb, err := b.e.Get(ctx, b.w.id)
	if err != nil {
		return err
	}
	root := b.e.PoolPath(sb.Root)
	cb, err := container.New(filepath.Join(root, initctl.Dir, initctl.InitBin))
	if err != nil {
		return err
	}
	src := &isolation.Sandbox{ID: sb.ID, Hostname: sb.Hostname, Root: root, Limits: sb.Limits, Init: sb.Init,
		Cgroup: path.Base(sb.Root)}
	var cks []copytreeCheckpoint
	var samples, storage, images []float64
	settleDeletions(ctx, s.root)
	for k := 0; k < n; k++ {
		if err := b.w.step(ctx); err != nil {
			return err
		}
		want, err := b.w.record(ctx)
		if err != nil {
			return err
		}
		ck := copytreeCheckpoint{root: s.path(fmt.Sprintf("ck%d", k)), images: s.path(fmt.Sprintf("images%d", k)), want: want}
		if err := os.MkdirAll(ck.images, 0o700); err != nil {
			return err
		}
		before, err := poolUsed(s.root)
		if err != nil {
			return err
		}
		start := time.Now()
		err = cb.Checkpoint(ctx, src, ck.images, isolation.Hooks{Frozen: func(ctx context.Context) error {
			return copyTree(ctx, root, ck.root)
		}})
		if err != nil {
			return err
		}
		samples = append(samples, ms(time.Since(start)))
		after, err := poolUsed(s.root)
		if err != nil {
			return err
		}
		storage = append(storage, float64(after-before))
		images = append(images, float64(engine.DirBytes(ck.images)))
		cks = append(cks, ck)
	}
	br.CheckpointMS = summarize(samples)
	changed, err := b.w.stepChangedBytes(ctx)
	if err != nil {
		return err
	}
	br.setStorage(storage, images, changed)
	return b.copytreeRollbacks(ctx, s, cb, cks, n, br)
}

func (b *runner) copytreeRollbacks(ctx context.Context, s *scratch, cb *container.Backend, cks []copytreeCheckpoint, n int, br *BaselineReport) error {
	var cur *isolation.Sandbox
	defer func() {
		if cur != nil {
			cb.Stop(context.WithoutCancel(ctx), cur)
		}
	}()
	var samples []float64
	for i := 0; i < n; i++ {
		ck := cks[b.rng.IntN(len(cks))]
		next := &isolation.Sandbox{ID: fmt.Sprintf("ct%s%d", s.rel[len(s.rel)-6:], i), Root: s.path(fmt.Sprintf("rb%d", i))}
		next.Hostname = next.ID
		start := time.Now()
		if cur != nil {
			if err := cb.Stop(ctx, cur); err != nil {
				return err
			}
			cur = nil
		}
		if err := copyTree(ctx, ck.root, next.Root); err != nil {
			return err
		}
		if err := cb.Restore(ctx, next, ck.images); err != nil {
			return err
		}
		samples = append(samples, ms(time.Since(start)))
		cur = next
		r := &repl{t: fileTransport{cb, cur, b.w.py}, off: ck.want.StdoutOff, seq: b.w.repl.seq}
		if err := r.verify(ctx, ck.want.REPL); err != nil {
			return fmt.Errorf("state after rollback: %w", err)
		}
		br.Checks++
	}
	br.RollbackMS = summarize(samples)
	return nil
}
