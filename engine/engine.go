// Package engine is cairn's core library: it creates sandboxes from templates and
// checkpoints, rolls back and forks them, jointly over their filesystem (a btrfs pool)
// and their process tree (an isolation backend).
//
// A checkpoint is published atomically. Its two halves are built under
// pool/staging/<sandbox>-<checkpoint> while the sandbox is frozen, the directory is
// renamed to pool/checkpoints/<checkpoint>, and only then is the metadata row written.
// A crash leaves a staging directory or an unrecorded checkpoint directory, both of
// which recovery deletes; no half checkpoint is ever listed.
//
// Several processes (CLI invocations, the daemon) may use one data directory at once.
// Operations on one sandbox are serialized by an flock on locks/<sandbox>; recovery
// only removes leftovers of sandboxes whose lock it can take.
package engine

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"math/big"
	"os"
	"path"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/criu"
	"github.com/cairn-sandbox/cairn/engine/model"
	"github.com/cairn-sandbox/cairn/errdefs"
	"github.com/cairn-sandbox/cairn/isolation"
	"github.com/cairn-sandbox/cairn/isolation/container"
	"github.com/cairn-sandbox/cairn/isolation/gvisor"
	"github.com/cairn-sandbox/cairn/storage"
	"github.com/cairn-sandbox/cairn/storage/btrfs"
	"github.com/cairn-sandbox/cairn/store"
	"github.com/cairn-sandbox/cairn/template"
)

// Config configures an Engine. Zero fields take the defaults in parentheses.
type Config struct {
	DataDir   string // (/var/lib/cairn) metadata, locks and the pool
	PoolDir   string // (DataDir/pool) btrfs pool mount point or btrfs directory
	PoolImage string // (DataDir/pool.img) sparse image mounted at PoolDir; "none" to use PoolDir as is
	PoolSize  int64  // (64 GiB) apparent size of a new pool image
	// ImagePool is the sparse image of the btrfs filesystem that holds new checkpoints'
	// process images, mounted at DataDir/imgs (DataDir/imgs.img): there a checkpoint's
	// images share, on disk, the pages equal to its parent's (reflinks; see
	// incremental.go) and stay full and standalone. "none" keeps them on the data
	// directory's own filesystem, in incremental chains of parent links (as before).
	ImagePool string
	// InitBinary is the cairn-init binary (next to the running executable, or on PATH).
	InitBinary string
	// Progress receives progress of long work (template builds); nil for none.
	Progress template.Progress
	// Standbys is how many frozen restored copies of each new checkpoint to prepare in
	// the background (0: the default, 1; -1: none). See standby.go.
	Standbys int
	// StandbyBudget bounds the memory all standbys hold (DefaultStandbyBudget), and
	// MaxStandbys their number (DefaultMaxStandbys).
	StandbyBudget int64
	MaxStandbys   int
	// StandbyRestores is how many standby restores run at once, at nice 19 (default 1).
	// More keep more standbys ready behind a busy loop, at the cost of checkpoint
	// latency: on 2 CPUs, 2 took W3 from 18 to 33 resets/s and W2's rollback p99 from
	// 289 to 6.5 ms, but W1's checkpoint p50 from ~79 to ~92 ms (the restores compete
	// for memory bandwidth and the page allocator with the dump, nice or not).
	StandbyRestores int
	// Residents is how many checkpoints of each sandbox stay resident (held by zygotes,
	// see resident.go) once durable (0: DefaultResidents; -1: none, every checkpoint is
	// a CRIU dump). A soft cap: checkpoints whose durable copy is pending stay resident
	// beyond it until the copy is written.
	Residents int
	// ResidentMemory bounds the memory a sandbox's zygotes hold beyond what its
	// processes map (isolation.Resident.ResidentMemory), which counts against the
	// sandbox's memory limit: beyond it, the durable resident checkpoints least likely
	// to be rolled back to lose their zygotes first (0: a quarter of the sandbox's memory
	// limit, or of isolation.DefaultMemoryBytes without one; -1: no bound but Residents).
	ResidentMemory int64
	// NoRewinds makes every rollback to a resident checkpoint fork from its zygotes,
	// never rewind the processes in place (isolation/container/zygote/rewind.go); the
	// environment's CAIRN_REWIND=0 does too.
	NoRewinds bool
	// NoTreePlans makes every revert of a root in place compute its difference with
	// the kernel's send rather than from the volumes' changed items (a tree plan:
	// storage/btrfs/treeplan.go); the environment's CAIRN_TREE_PLANS=0 does too.
	NoTreePlans bool
	// NoSplitSnapshots makes a checkpoint's processes wait, and its call return, until
	// its filesystem's snapshot is committed, not only fixed (split snapshots:
	// storage.SplitSnapshotter, storage/btrfs/fixed.go); the environment's
	// CAIRN_SPLIT_SNAPSHOTS=0 does too.
	NoSplitSnapshots bool
	// Logf reports problems of background work (default: discarded).
	Logf func(format string, args ...any)
}

// DefaultDataDir is where cairn keeps its state unless told otherwise.
const DefaultDataDir = "/var/lib/cairn"

// DefaultTemplate is the template Create uses when none is named.
const DefaultTemplate = "debian"

// Engine is cairn's core. Its methods are safe for concurrent use.
type Engine struct {
	cfg      Config
	pool     storage.Pool
	btrfs    *btrfs.Pool
	db       *store.Store
	backends map[string]isolation.Backend

	// presence holds the data directory's shared engine lock; alone says that no other
	// engine was alive on it when this one opened (joinDataDir).
	presence *os.File
	alone    bool

	// bgWG counts background work (standby preparation, cleanup); Close waits for it.
	bgWG sync.WaitGroup
	// closing is closed when Close begins: background work that waits on something
	// that may never come (another engine's lock) gives up then.
	closing   chan struct{}
	closeOnce sync.Once
	bgMu      sync.Mutex
	// bgStats counts background work; protected by bgMu.
	bgStats Stats
	// pending counts standbys being prepared, by checkpoint; protected by bgMu.
	pending map[string]int
	// prepSem bounds concurrent standby restores (Config.StandbyRestores): they are
	// CPU-bound and run beside sandboxes.
	prepSem chan struct{}
	// compactQ is the queue of checkpoints to compact, compacting whether its worker
	// runs; both protected by bgMu. See incremental.go.
	compactQ   []string
	compacting bool
	// compactMu is the in-process half of the compaction lock (lockCompaction).
	compactMu sync.Mutex
	// images guards image directories: CRIU restores read-lock it, rewrites of a
	// directory's pagemaps and links lock it.
	images *imagesGuard
	// imgRoot is where new checkpoints' images go: sharedImagesDir when the image pool
	// is mounted, imagesDir otherwise (checkpoint.go).
	imgRoot string
	imgPool *btrfs.Pool // the image pool, when mounted (nil otherwise)
	// durable queues the durable copies of resident checkpoints (resident.go).
	durable durableState
	// removing holds, by sandbox, the process records whose removal runs in the
	// background (exec.go); protected by bgMu.
	removing map[string]map[string]bool
}

// Open opens (creating on first use) the data directory and its pool.
func Open(ctx context.Context, cfg Config) (*Engine, error) {
	if os.Geteuid() != 0 {
		return nil, errdefs.PermissionDenied("cairn needs root (namespaces, cgroups, CRIU, btrfs): run it with sudo")
	}
	spareProcs()
	if cfg.DataDir == "" {
		cfg.DataDir = DefaultDataDir
	}
	if cfg.PoolDir == "" {
		cfg.PoolDir = filepath.Join(cfg.DataDir, "pool")
	}
	switch cfg.PoolImage {
	case "":
		cfg.PoolImage = filepath.Join(cfg.DataDir, "pool.img")
	case "none":
		cfg.PoolImage = ""
	}
	if cfg.InitBinary == "" {
		cfg.InitBinary = findInit()
	}
	if cfg.Standbys == 0 {
		cfg.Standbys = 1
	}
	if cfg.StandbyBudget == 0 {
		cfg.StandbyBudget = DefaultStandbyBudget
	}
	if cfg.StandbyRestores <= 0 {
		cfg.StandbyRestores = 1
	}
	if cfg.MaxStandbys == 0 {
		cfg.MaxStandbys = DefaultMaxStandbys
	}
	if cfg.Residents == 0 {
		cfg.Residents = DefaultResidents
	}
	if cfg.Logf == nil {
		cfg.Logf = func(string, ...any) {}
	}
	cfg.NoSplitSnapshots = cfg.NoSplitSnapshots || os.Getenv("CAIRN_SPLIT_SNAPSHOTS") == "0"
	for _, d := range []string{cfg.DataDir, filepath.Join(cfg.DataDir, "locks")} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, fmt.Errorf("data directory: %w", err)
		}
	}
	pool, err := btrfs.Open(ctx, btrfs.Config{Dir: cfg.PoolDir, Image: cfg.PoolImage, Size: cfg.PoolSize,
		NoTreePlans: cfg.NoTreePlans || os.Getenv("CAIRN_TREE_PLANS") == "0"})
	if err != nil {
		return nil, err
	}
	db, err := store.Open(filepath.Join(cfg.DataDir, "cairn.db"))
	if err != nil {
		return nil, err
	}
	e := &Engine{cfg: cfg, pool: pool, btrfs: pool, db: db, backends: map[string]isolation.Backend{}, pending: map[string]int{}, closing: make(chan struct{}), prepSem: make(chan struct{}, cfg.StandbyRestores),
		images: &imagesGuard{path: filepath.Join(cfg.DataDir, "images.lock")}, imgRoot: imagesDir}
	if cfg.ImagePool != "none" {
		image := cfg.ImagePool
		if image == "" {
			image = filepath.Join(cfg.DataDir, sharedImagesDir+".img")
		}
		if ip, err := btrfs.Open(ctx, btrfs.Config{Dir: filepath.Join(cfg.DataDir, sharedImagesDir), Image: image}); err != nil {
			cfg.Logf("image pool %s: %v; new checkpoints' images go to %s, in incremental chains", image, err, filepath.Join(cfg.DataDir, imagesDir))
		} else {
			e.imgRoot, e.imgPool = sharedImagesDir, ip
		}
	}
	if err := criu.UseKdatCache(filepath.Join(cfg.DataDir, "criu")); err != nil {
		return nil, err
	}
	if cb, err := container.New(cfg.InitBinary); err == nil {
		cb.Logf = cfg.Logf
		cb.NoRewinds = cfg.NoRewinds || os.Getenv("CAIRN_REWIND") == "0"
		e.backends["container"] = guardedContainer{Backend: cb, images: e.images}
	} else {
		e.backends["container"] = unavailable{name: "container", err: err}
	}
	if gb, err := gvisor.New(cfg.InitBinary, filepath.Join(cfg.DataDir, "runsc")); err == nil {
		e.backends["gvisor"] = gb
	} else {
		e.backends["gvisor"] = unavailable{name: "gvisor", err: err}
	}
	if e.presence, e.alone, err = joinDataDir(cfg.DataDir); err != nil {
		db.Close()
		return nil, err
	}
	if err := e.recover(ctx); err != nil {
		e.presence.Close()
		db.Close()
		return nil, fmt.Errorf("recovery: %w", err)
	}
	return e, nil
}

// joinDataDir announces an engine on dataDir: every open engine holds a shared lock on
// locks/engines, and the one that could take it alone first (no other engine alive on
// the directory: cairn restarted) says so. Resident checkpoints are another live
// engine's work (its zygotes, its durable copies, its snapshots still being made): only
// an engine alone recovers them (recoverResidents, recoverLost).
func joinDataDir(dataDir string) (*os.File, bool, error) {
	f, err := os.OpenFile(filepath.Join(dataDir, "locks", "engines"), os.O_CREATE|os.O_RDWR|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, false, fmt.Errorf("data directory: %w", err)
	}
	alone := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB) == nil
	// Shared from now on (from exclusive, a conversion): engines that start later see
	// this one.
	if err := unix.Flock(int(f.Fd()), unix.LOCK_SH); err != nil {
		f.Close()
		return nil, false, fmt.Errorf("data directory: lock %s: %w", f.Name(), err)
	}
	return f, alone, nil
}

// Close waits for background work and releases the engine. Sandboxes keep running.
func (e *Engine) Close() error {
	e.closeOnce.Do(func() { close(e.closing) })
	e.bgWG.Wait()
	for _, b := range e.backends {
		if c, ok := b.(io.Closer); ok {
			c.Close() // idle CRIU workers, tracking of writes (isolation/container)
		}
	}
	if e.imgPool != nil {
		e.imgPool.Close()
	}
	e.presence.Close()
	return e.db.Close()
}

// DataDir returns the data directory in use.
func (e *Engine) DataDir() string { return e.cfg.DataDir }

// findInit looks for cairn-init next to the running executable, then on PATH.
func findInit() string {
	if exe, err := os.Executable(); err == nil {
		p := filepath.Join(filepath.Dir(exe), "cairn-init")
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	for _, dir := range filepath.SplitList(os.Getenv("PATH")) {
		p := filepath.Join(dir, "cairn-init")
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	return "/usr/local/bin/cairn-init"
}

// DefaultIsolation is the backend Create uses when none is named: gVisor, the stronger
// boundary (a user-space kernel between the sandbox and the host), where runsc is
// installed; the container backend otherwise.
func (e *Engine) DefaultIsolation() string {
	if _, ok := e.backends["gvisor"].(unavailable); ok {
		return "container"
	}
	return "gvisor"
}

func (e *Engine) backend(name string) (isolation.Backend, error) {
	b, ok := e.backends[name]
	if !ok {
		known := make([]string, 0, len(e.backends))
		for k := range e.backends {
			known = append(known, k)
		}
		return nil, errdefs.InvalidArgument("isolation %q is not available (available: %s)", name, strings.Join(known, ", "))
	}
	return b, nil
}

const idAlphabet = "0123456789abcdefghijklmnopqrstuvwxyz"

// newID returns a random lowercase alphanumeric ID of n characters, starting with prefix.
func newID(prefix string, n int) string {
	var sb strings.Builder
	sb.WriteString(prefix)
	max := big.NewInt(int64(len(idAlphabet)))
	for i := 0; i < n; i++ {
		v, _ := rand.Int(rand.Reader, max)
		sb.WriteByte(idAlphabet[v.Int64()])
	}
	return sb.String()
}

// validID reports whether id is a well-formed cairn ID.
func validID(id string) bool {
	if id == "" || len(id) > 64 {
		return false
	}
	for _, c := range id {
		if !strings.ContainsRune(idAlphabet, c) {
			return false
		}
	}
	return true
}

// lock takes the per-sandbox lock (exclusive or shared) and returns its release.
func (e *Engine) lock(ctx context.Context, id string, exclusive bool) (func(), error) {
	f, err := os.OpenFile(filepath.Join(e.cfg.DataDir, "locks", id), os.O_CREATE|os.O_RDWR|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, err
	}
	how := unix.LOCK_SH
	if exclusive {
		how = unix.LOCK_EX
	}
	for {
		err := unix.Flock(int(f.Fd()), how|unix.LOCK_NB)
		if err == nil {
			return func() { f.Close() }, nil
		}
		if !errors.Is(err, unix.EWOULDBLOCK) {
			f.Close()
			return nil, err
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, ctx.Err()
		case <-time.After(2 * time.Millisecond):
		}
	}
}

// tryLock takes the exclusive lock of id only if nobody holds it.
func (e *Engine) tryLock(id string) (func(), bool) {
	f, err := os.OpenFile(filepath.Join(e.cfg.DataDir, "locks", id), os.O_CREATE|os.O_RDWR|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, false
	}
	if unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB) != nil {
		f.Close()
		return nil, false
	}
	return func() { f.Close() }, true
}

// isb is the backend's view of a sandbox record.
func (e *Engine) isb(sb *model.Sandbox) *isolation.Sandbox {
	// Each root generation has its own cgroups, so a new tree can start while the old
	// one is still being torn down.
	return &isolation.Sandbox{ID: sb.ID, Hostname: sb.Hostname, Root: e.pool.Path(sb.Root), Limits: sb.Limits,
		Init: sb.Init, Cgroup: path.Base(sb.Root)}
}

// refresh sets sb.State from whether its init is alive.
func (e *Engine) refresh(sb *model.Sandbox) {
	b, err := e.backend(sb.Isolation)
	if err == nil && sb.State == model.StateRunning && !b.Running(e.isb(sb)) {
		sb.State = model.StateStopped
		sb.Init = isolation.Proc{}
	}
}

// unavailable stands in for a backend that cannot run here, and says why.
type unavailable struct {
	isolation.Backend
	name string
	err  error
}

func (u unavailable) Name() string                                    { return u.name }
func (u unavailable) Running(*isolation.Sandbox) bool                 { return false }
func (u unavailable) Start(context.Context, *isolation.Sandbox) error { return u.err }
func (u unavailable) Restore(context.Context, *isolation.Sandbox, string) error {
	return u.err
}
func (u unavailable) Stop(context.Context, *isolation.Sandbox) error { return nil }
