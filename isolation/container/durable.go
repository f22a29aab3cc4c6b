package container

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strconv"

	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/criu"
	"github.com/cairn-sandbox/cairn/criu/fixup"
	"github.com/cairn-sandbox/cairn/isolation"
	"github.com/cairn-sandbox/cairn/isolation/container/freezer"
	"github.com/cairn-sandbox/cairn/isolation/container/zygote"
)

// Durable copies of resident checkpoints, and their restore.
//
// A resident checkpoint's directory gets, next to its zygote record, procs/<pid>/: the
// CRIU images of each process, dumped alone from its zygote by CRIU running inside the
// sandbox (criu.DumpInside), then rewritten (criu/fixup) into the images of the process
// the zygote copies, at the checkpoint. procs/ is built as procs.tmp/ and renamed: it is
// there whole or not at all. Init is in none of them: it keeps no state but what it
// writes under /.cairn, which the checkpoint's filesystem holds. A restore boots a fresh
// init on the checkpoint's root, restores each process into the sandbox as init's child
// with its PID (criu.RestoreInside), and has init learn them (reload).

// procsDir is the subdirectory of per-process images.
const procsDir = "procs"

// MakeDurable implements isolation.Resident.
func (b *Backend) MakeDurable(ctx context.Context, sb *isolation.Sandbox, dir string) error {
	defer b.res.dirLock(dir)()
	if _, err := os.Stat(filepath.Join(dir, procsDir)); err == nil {
		return nil // done already
	}
	rec, ok, err := zygote.Read(dir)
	if err != nil {
		return err
	}
	if !ok {
		return fmt.Errorf("%s has no zygote record", dir)
	}
	if rec.Init != sb.Init || !rec.Alive() {
		return fmt.Errorf("%w: the zygotes of %s are gone", isolation.ErrNotResident, dir)
	}
	// A crash in the middle of a rollback may have left them thawed (parked).
	if err := zygote.Settle(b.res.tr(), rec); errors.Is(err, zygote.ErrLost) {
		return fmt.Errorf("%w: %v", isolation.ErrNotResident, err)
	} else if err != nil {
		return err
	}
	tmp := filepath.Join(dir, procsDir+".tmp")
	os.RemoveAll(tmp)
	if err := os.Mkdir(tmp, 0o700); err != nil {
		return err
	}
	// Already there but after a rollback to a checkpoint of another boot: CRIU loads it,
	// and leaves the root alone (criu.InstallKdatInside).
	if err := criu.InstallKdatInside(sb.Root); err != nil {
		return err
	}
	cg, err := criuCgroup(sb.CgroupName())
	if err != nil {
		return err
	}
	for _, p := range rec.Procs {
		out := filepath.Join(tmp, strconv.Itoa(p.NSPid))
		if err := os.Mkdir(out, 0o700); err != nil {
			return err
		}
		if err := criu.DumpInside(ctx, criu.InsideDumpOptions{InitPid: sb.Init.Pid, Pid: p.ZygoteNSPid,
			ImagesDir: out, FreezeCgroup: p.Cgroup, Cgroups: []string{filepath.Join(cg, "cgroup.procs")},
			Background: true}); err != nil {
			return fmt.Errorf("dump the zygote of process %d: %w", p.NSPid, err)
		}
		if err := fixup.Apply(out, specOf(p)); err != nil {
			return fmt.Errorf("images of process %d: %w", p.NSPid, err)
		}
		// Restored alone into a running sandbox, the process must stay in its time
		// namespace: CRIU puts a restored tree into a new one, its clocks offset to
		// continue from the dump's, unless the clock values were not dumped (no image;
		// criu/timens.c). A time namespace of its own would also make the sandbox's tree
		// undumpable ("nested time namespace").
		if err := os.Remove(filepath.Join(out, "timens-0.img")); err != nil && !os.IsNotExist(err) {
			return err
		}
	}
	if err := syncDir(tmp); err != nil {
		return err
	}
	if err := os.Rename(tmp, filepath.Join(dir, procsDir)); err != nil {
		return err
	}
	return syncDir(dir)
}

// criuCgroup is the freezer cgroup CRIU runs in when it dumps zygotes of a sandbox from
// inside: each process it starts takes the next PID of the sandbox's namespace, and a
// rollback, which sets that next PID to the one each process must get again, freezes
// it for the few forks it makes (holdCRIU).
func criuCgroup(cgroup string) (string, error) {
	dir := criuDir(cgroup)
	return dir, os.MkdirAll(dir, 0o755)
}

// criuDir is the freezer cgroup directory of a sandbox's background CRIU.
func criuDir(cgroup string) string { return filepath.Join(cgroupRoot, "freezer", "cairn-criu", cgroup) }

// holdCRIU freezes the sandbox's background CRIU, if one runs, and returns the thaw.
func holdCRIU(cgroup string) (func(), error) {
	release, held := holdCRIUSoon(cgroup)
	if err := held(); err != nil {
		release()
		return nil, err
	}
	return release, nil
}

// holdCRIUSoon asks the sandbox's background CRIU, if one runs, to freeze, without
// waiting: it returns the thaw, and held, which waits until the freeze is complete.
// What only needs CRIU off the CPUs (a checkpoint's stop, a rewind in place) goes on at
// once; what needs it frozen (the PIDs a rollback's forks take) calls held first. A
// CRIU in the middle of a write took up to 2 ms to freeze, ~1 rollback in 10 of W1.
func holdCRIUSoon(cgroup string) (release func(), held func() error) {
	dir := criuDir(cgroup)
	if len(freezer.Procs(dir)) == 0 {
		return func() {}, func() error { return nil }
	}
	release = func() { freezer.Write(dir, freezer.Thawed) }
	if err := freezer.Write(dir, freezer.Frozen); err != nil {
		return release, func() error { return err }
	}
	return release, func() error { return freezer.Set(dir, freezer.Frozen) }
}

// specOf is what the images of p's zygote must become.
func specOf(p zygote.Proc) fixup.Spec {
	s := fixup.Spec{Pid: p.NSPid, Cwd: p.Cwd.Path, Exe: p.Exe, PdeathSig: p.PdeathSig, ChildSubreaper: p.ChildSubreaper, Dumpable: p.Dumpable}
	pipes := map[uint64]bool{} // a pipe open on two descriptors (both its ends, a dup) has one content
	for _, f := range p.Fds {
		switch f.Kind {
		case zygote.KindPipe:
			s.Files = append(s.Files, fixup.File{Fd: f.Fd, Path: fmt.Sprintf("pipe:[%d]", f.Ino), Flags: f.Flags})
		default:
			s.Files = append(s.Files, fixup.File{Fd: f.Fd, Path: f.Path, Flags: f.Flags, Pos: f.Pos})
		}
		if (f.Kind == zygote.KindPipe || f.Kind == zygote.KindFIFO) && !pipes[f.Ino] {
			pipes[f.Ino] = true
			s.Pipes = append(s.Pipes, fixup.Pipe{Ino: f.Ino, Data: f.Data})
		}
	}
	for _, l := range p.Locks {
		s.Locks = append(s.Locks, fixup.Lock{Fd: l.Fd, Write: l.Write, Start: l.Start, Len: l.Len})
	}
	for _, m := range p.Maps {
		s.Maps = append(s.Maps, fixup.Map{Start: m.Start, Path: m.Path})
	}
	return s
}

func syncDir(dir string) error {
	f, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer f.Close()
	return f.Sync()
}

// perProcess reports whether dir holds per-process images (a resident checkpoint made
// durable) rather than the images of the whole tree.
func perProcess(dir string) bool {
	_, err := os.Stat(filepath.Join(dir, procsDir))
	return err == nil
}

// restoreProcs restores per-process images: a fresh init on sb.Root, each process
// restored into the sandbox as its child, then init reloads. frozen: every task, init
// included, is left frozen (a standby), none having run an instruction of its own.
func (b *Backend) restoreProcs(ctx context.Context, sb *isolation.Sandbox, dir string, frozen bool) error {
	pids, err := procsOf(dir)
	if err != nil {
		return err
	}
	// The PID base is set after the processes are back: until then init's threads take
	// low PIDs, below those of the processes (UserPidBase and up).
	if err := b.start(ctx, sb, false); err != nil {
		return err
	}
	if err := b.restoreInto(ctx, sb, dir, pids, frozen); err != nil {
		b.Stop(ctx, sb)
		return err
	}
	return nil
}

// RollbackDurable is RollbackResident for a checkpoint of sb whose zygotes are gone but
// whose durable copy is per-process images: the processes are restored from them into
// sb's running init. The sandbox keeps its generation, so the zygotes of its other
// checkpoints stay usable (a rollback that started a new init would strand them: each
// would have to be dumped first).
func (b *Backend) RollbackDurable(ctx context.Context, sb *isolation.Sandbox, dir string, hooks isolation.RollbackHooks) error {
	if !perProcess(dir) {
		return fmt.Errorf("%w: the checkpoint's images are of the whole tree", isolation.ErrNotResident)
	}
	pids, err := procsOf(dir)
	if err != nil {
		return err
	}
	if !b.Running(sb) {
		return fmt.Errorf("%w: sandbox %s is not running", isolation.ErrNotResident, sb.ID)
	}
	release, err := killAndRevert(ctx, sb, hooks)
	if err != nil {
		return err
	}
	defer release()
	return b.restoreInto(ctx, sb, dir, pids, false)
}

// procsOf lists the PIDs (in the sandbox) of the processes whose images dir holds.
func procsOf(dir string) ([]int, error) {
	ents, err := os.ReadDir(filepath.Join(dir, procsDir))
	if err != nil {
		if _, ok, _ := zygote.Read(dir); ok && errors.Is(err, fs.ErrNotExist) {
			return nil, errors.New("the checkpoint is held in memory only: its durable copy is not written (yet)")
		}
		return nil, err
	}
	var pids []int
	for _, e := range ents {
		if n, err := strconv.Atoi(e.Name()); err == nil {
			pids = append(pids, n)
		}
	}
	sort.Ints(pids) // CRIU restores with set PIDs; order only matters for the log
	return pids, nil
}

// restoreInto restores the processes pids of dir's per-process images into sb, whose
// init runs (and has no other child but the zygotes'), then has init reload them. On
// failure, what it restored is killed and init runs again.
func (b *Backend) restoreInto(ctx context.Context, sb *isolation.Sandbox, dir string, pids []int, frozen bool) error {
	// Init is frozen while the processes come back: each new thread of its runtime takes
	// the next PID of the namespace, which could be one still to restore. CRIU joins the
	// sandbox's cgroups but for the freezer's (it would freeze there); each process,
	// restored stopped, goes into the sandbox's freezer cgroup, and runs once init knows
	// it.
	if err := freeze(sb.CgroupName()); err != nil {
		return err
	}
	var restored []int
	fail := func(err error) error {
		for _, p := range restored {
			unix.Kill(p, unix.SIGKILL)
		}
		thaw(sb.CgroupName())
		return err
	}
	var cgroups []string
	for _, h := range present() {
		if h.dir != "freezer" {
			cgroups = append(cgroups, filepath.Join(ctrlDir(h.dir, sb.CgroupName()), "cgroup.procs"))
		}
	}
	work, err := os.MkdirTemp("", "cairn-restore-")
	if err != nil {
		return fail(err)
	}
	defer os.RemoveAll(work)
	for _, pid := range pids {
		w := filepath.Join(work, strconv.Itoa(pid))
		if err := os.Mkdir(w, 0o700); err != nil {
			return fail(err)
		}
		host, err := criu.RestoreInside(ctx, criu.InsideRestoreOptions{InitPid: sb.Init.Pid,
			ImagesDir: filepath.Join(dir, procsDir, strconv.Itoa(pid)), WorkDir: w,
			KeepLog: filepath.Join(os.TempDir(), "cairn-restore-"+sb.ID+".log"),
			Cgroups: cgroups, LeaveStopped: true, Background: frozen})
		if err == nil {
			restored = append(restored, host)
			err = os.WriteFile(filepath.Join(ctrlDir("freezer", sb.CgroupName()), "cgroup.procs"), []byte(strconv.Itoa(host)), 0)
		}
		if err != nil {
			return fail(fmt.Errorf("restore process %d: %w", pid, err))
		}
	}
	err = thaw(sb.CgroupName())
	if err == nil {
		err = b.res.setPidBase(sb.Init)
	}
	if err == nil {
		err = b.reload(ctx, sb)
	}
	if err != nil {
		return fail(err)
	}
	if frozen {
		return freezeStopped(sb.CgroupName()) // a standby: held by the freezer
	}
	for _, p := range restored {
		unix.Kill(p, unix.SIGCONT)
	}
	return nil
}
