package bench

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"

	"github.com/cairn-sandbox/cairn/storage/btrfs"
)

// runBaselines measures the baselines on the W1 state, recording each one's error
// instead of failing the run.
func (b *runner) runBaselines(ctx context.Context) {
	b.rep.Baselines = map[string]*BaselineReport{}
	b.rep.Ratios = map[string]Ratios{}
	for _, bl := range []struct {
		name string
		n    int
		run  func(context.Context, *scratch, int, *BaselineReport) error
	}{
		{"runc_criu", b.opts.Iterations, b.runcBaseline},
		{"runsc", b.opts.Iterations, b.runscBaseline},
		// Every copytree checkpoint copies the whole root (~400 MB): keep it short.
		{"copytree", min(b.opts.Iterations, 10), b.copytreeBaseline},
	} {
		b.phase("baseline %s: %d checkpoints and rollbacks", bl.name, bl.n)
		br := &BaselineReport{}
		s, err := newScratch(ctx, b.e.PoolPath(""), bl.name)
		if err == nil {
			err = bl.run(ctx, s, bl.n, br)
			if cerr := s.cleanup(context.WithoutCancel(ctx)); err == nil {
				err = cerr
			}
		}
		if err != nil {
			br.Error = err.Error()
			b.phase("baseline %s failed: %v", bl.name, err)
		} else {
			b.rep.Ratios[bl.name] = b.ratios(br)
		}
		b.rep.Baselines[bl.name] = br
	}
}

// ratios compares a baseline's p50s (and storage ratio) with cairn's.
func (b *runner) ratios(br *BaselineReport) Ratios {
	r := b.rep
	return Ratios{
		Checkpoint: ratio(br.CheckpointMS.P50, summarize(b.ckMS).P50),
		Rollback:   ratio(br.RollbackMS.P50, summarize(b.rbMS).P50),
		Fork16:     ratio(br.Fork16MS.P50, r.Fork16MS.P50),
		Storage:    ratio(br.StorageRatio, r.StorageRatio),
	}
}

// setStorage records a baseline's storage per checkpoint (pool used-bytes deltas),
// image bytes per checkpoint, and its storage ratio: the mean storage per checkpoint
// over the bytes one step changed, as Report.StorageRatio.
func (br *BaselineReport) setStorage(storage, images []float64, changed int64) {
	br.StorageBytesPerCheckpoint = summarize(storage)
	br.ImageBytesPerCheckpoint = summarize(images)
	br.StepChangedBytes = changed
	if changed > 0 {
		br.StorageRatio = br.StorageBytesPerCheckpoint.Mean / float64(changed)
	}
}

// scratch is a baseline's working area: a plain directory in the engine's pool (so
// snapshots and copies stay on the same filesystem), and the volumes made in it.
type scratch struct {
	pool *btrfs.Pool
	root string // the pool's directory
	rel  string // pool-relative directory

	mu sync.Mutex
	// vols are the volumes made and not yet deleted; protected by mu.
	vols []string
}

func newScratch(ctx context.Context, poolRoot, name string) (*scratch, error) {
	if poolRoot == "" {
		return nil, fmt.Errorf("engine has no pool path")
	}
	pool, err := btrfs.Open(ctx, btrfs.Config{Dir: poolRoot})
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp(poolRoot, "bench-"+name+"-")
	if err != nil {
		pool.Close()
		return nil, err
	}
	return &scratch{pool: pool, root: poolRoot, rel: filepath.Base(dir)}, nil
}

// path returns the host path of name inside the scratch directory.
func (s *scratch) path(name string) string { return s.pool.Path(s.rel + "/" + name) }

// snapshot snapshots a pool volume into the scratch directory as name.
func (s *scratch) snapshot(ctx context.Context, src, name string, readonly bool) (string, error) {
	vol := s.rel + "/" + name
	if err := s.pool.Snapshot(ctx, src, vol, readonly); err != nil {
		return "", err
	}
	s.mu.Lock()
	s.vols = append(s.vols, vol)
	s.mu.Unlock()
	return vol, nil
}

// delete deletes a volume snapshot made.
func (s *scratch) delete(ctx context.Context, vol string) error {
	if err := s.pool.Delete(ctx, vol); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, v := range s.vols {
		if v == vol {
			s.vols = append(s.vols[:i], s.vols[i+1:]...)
			break
		}
	}
	return nil
}

// cleanup deletes the scratch volumes and directory.
func (s *scratch) cleanup(ctx context.Context) error {
	defer s.pool.Close()
	s.mu.Lock()
	defer s.mu.Unlock()
	var first error
	for i := len(s.vols) - 1; i >= 0; i-- {
		if err := s.pool.Delete(ctx, s.vols[i]); err != nil && first == nil && s.pool.Exists(s.vols[i]) {
			first = err
		}
	}
	if err := os.RemoveAll(s.pool.Path(s.rel)); err != nil && first == nil {
		first = err
	}
	return first
}

// copyTree copies src to dst (which must not exist) with `cp -a --reflink=never`: a
// real copy of every byte, as the copytree baseline does.
func copyTree(ctx context.Context, src, dst string) error {
	out, err := exec.CommandContext(ctx, "cp", "-a", "--reflink=never", src, dst).CombinedOutput()
	if err != nil {
		return fmt.Errorf("cp -a %s: %v: %s", src, err, tail(out, 400))
	}
	return nil
}

// pipeTransport reaches a REPL whose stdin and stdout are host pipes.
type pipeTransport struct {
	in  *os.File
	mu  sync.Mutex
	buf []byte
}

// newPipeTransport reads out in the background until it closes.
func newPipeTransport(in, out *os.File) *pipeTransport {
	t := &pipeTransport{in: in}
	go func() {
		b := make([]byte, 64<<10)
		for {
			n, err := out.Read(b)
			t.mu.Lock()
			t.buf = append(t.buf, b[:n]...)
			t.mu.Unlock()
			if err != nil {
				out.Close()
				return
			}
		}
	}()
	return t
}

func (t *pipeTransport) write(ctx context.Context, data []byte) error {
	_, err := t.in.Write(data)
	return err
}

func (t *pipeTransport) output(ctx context.Context, off int64) ([]byte, int64, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if off > int64(len(t.buf)) {
		return nil, off, nil
	}
	return append([]byte(nil), t.buf[off:]...), int64(len(t.buf)), nil
}
