package btrfs

import (
	"context"
	"errors"
	"fmt"
	"os"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/errdefs"
	"github.com/cairn-sandbox/cairn/storage"
)

// unchangedCases are changes a sandbox can make to its root, each of which Unchanged
// must see, whichever witness (the ctransid, or data in flight) sees it.
var unchangedCases = []struct {
	name   string
	change func(tb testing.TB, dir string)
}{
	{"overwrite a byte", func(tb testing.TB, d string) { writeAt(tb, d+"/home/u/notes.txt", 10, []byte("X")) }},
	{"append", func(tb testing.TB, d string) {
		f, err := os.OpenFile(d+"/etc/passwd", os.O_APPEND|os.O_WRONLY, 0)
		must(tb, err)
		defer f.Close()
		_, err = f.Write([]byte("x"))
		must(tb, err)
	}},
	{"write then write back", func(tb testing.TB, d string) {
		writeAt(tb, d+"/data.bin", 0, []byte("Y"))
		f, err := os.OpenFile(d+"/data.bin", os.O_RDWR, 0)
		must(tb, err)
		defer f.Close()
		must(tb, f.Sync())
	}},
	{"write through a shared mapping", func(tb testing.TB, d string) {
		f, err := os.OpenFile(d+"/data.bin", os.O_RDWR, 0)
		must(tb, err)
		defer f.Close()
		m, err := syscall.Mmap(int(f.Fd()), 0, 4096, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
		must(tb, err)
		m[7] = 'm'
		must(tb, syscall.Munmap(m))
	}},
	{"direct write", func(tb testing.TB, d string) {
		fd, err := unix.Open(d+"/data.bin", unix.O_WRONLY|unix.O_DIRECT, 0)
		must(tb, err)
		defer unix.Close(fd)
		buf, err := unix.Mmap(-1, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE) // aligned
		must(tb, err)
		defer unix.Munmap(buf)
		buf[0] = 'D'
		_, err = unix.Pwrite(fd, buf, 4096)
		must(tb, err)
	}},
	{"write into a no-copy-on-write file", func(tb testing.TB, d string) { writeAt(tb, d+"/nocow", 5, []byte("n")) }},
	{"create", func(tb testing.TB, d string) { writeFile(tb, d+"/new", "") }},
	{"mkdir", func(tb testing.TB, d string) { must(tb, os.Mkdir(d+"/newdir", 0o755)) }},
	{"unlink", func(tb testing.TB, d string) { must(tb, os.Remove(d+"/etc/hostname")) }},
	{"rename", func(tb testing.TB, d string) { must(tb, os.Rename(d+"/etc/hostname", d+"/etc/name")) }},
	{"hard link", func(tb testing.TB, d string) { must(tb, os.Link(d+"/etc/hostname", d+"/etc/h2")) }},
	{"symlink", func(tb testing.TB, d string) { must(tb, os.Symlink("x", d+"/sl")) }},
	{"truncate", func(tb testing.TB, d string) { must(tb, os.Truncate(d+"/data.bin", 10)) }},
	{"punch a hole", func(tb testing.TB, d string) {
		f, err := os.OpenFile(d+"/data.bin", os.O_RDWR, 0)
		must(tb, err)
		defer f.Close()
		must(tb, unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, 0, 8192))
	}},
	{"preallocate", func(tb testing.TB, d string) {
		f, err := os.OpenFile(d+"/data.bin", os.O_RDWR, 0)
		must(tb, err)
		defer f.Close()
		must(tb, unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_KEEP_SIZE, 1<<20, 1<<20))
	}},
	{"chmod", func(tb testing.TB, d string) { must(tb, os.Chmod(d+"/etc/hostname", 0o600)) }},
	{"chown", func(tb testing.TB, d string) { must(tb, os.Chown(d+"/etc/hostname", 7, 7)) }},
	{"utimes", func(tb testing.TB, d string) {
		must(tb, unix.UtimesNano(d+"/etc/hostname", []unix.Timespec{{Sec: 1}, {Sec: 2}}))
	}},
	{"set an extended attribute", func(tb testing.TB, d string) {
		must(tb, unix.Setxattr(d+"/etc/hostname", "user.x", []byte("1"), 0))
	}},
	{"reflink", func(tb testing.TB, d string) { reflink(tb, d+"/data.bin", d+"/copy") }},
	{"write to a FIFO", func(tb testing.TB, d string) {
		f, err := os.OpenFile(d+"/home/u/pipe", os.O_RDWR, 0)
		must(tb, err)
		defer f.Close()
		_, err = f.Write([]byte("x"))
		must(tb, err)
	}},
}

// TestUnchangedSeesEveryChange checks Unchanged on every kind of change, right after
// it (the data still dirty) and, for the data writes, once written back.
func TestUnchangedSeesEveryChange(t *testing.T) {
	requireRoot(t)
	p := openTest(t, testConfig(t, 2<<30))
	ctx := context.Background()
	for i, tc := range unchangedCases {
		t.Run(tc.name, func(t *testing.T) {
			live, snap := fmt.Sprintf("u%d/live", i), fmt.Sprintf("u%d/snap", i)
			must(t, p.Create(ctx, live))
			d := p.Path(live)
			base(t, d)
			nocow, err := os.Create(d + "/nocow")
			must(t, err)
			flags := 0x00800000 // FS_NOCOW_FL, set while the file is empty
			must(t, unix.IoctlSetPointerInt(int(nocow.Fd()), unix.FS_IOC_SETFLAGS, flags))
			_, err = nocow.Write(fill(64<<10, 'c'))
			must(t, err)
			must(t, nocow.Close())
			must(t, p.Snapshot(ctx, live, snap, true))
			if ok, err := p.Unchanged(live, snap); err != nil || !ok {
				t.Fatalf("Unchanged right after the snapshot = %v, %v; want true", ok, err)
			}
			tc.change(t, d)
			if ok, err := p.Unchanged(live, snap); err != nil || ok {
				t.Fatalf("Unchanged after the change = %v, %v; want false", ok, err)
			}
			must(t, p.Sync(ctx, live)) // written back and committed: the ctransid says it
			if ok, err := p.Unchanged(live, snap); err != nil || ok {
				t.Fatalf("Unchanged after the change was written back = %v, %v; want false", ok, err)
			}
		})
	}
}

// TestUnchangedCases covers what Unchanged must not vouch for.
func TestUnchangedCases(t *testing.T) {
	p := newPool(t)
	ctx := context.Background()
	live, snap := newRevertPair(t, p, "a")
	if ok, err := p.Unchanged(live, snap); err != nil || !ok {
		t.Fatalf("Unchanged(live, its snapshot) = %v, %v; want true", ok, err)
	}
	// A snapshot of another volume, with the same content.
	other, otherSnap := newRevertPair(t, p, "b")
	if ok, err := p.Unchanged(live, otherSnap); err != nil || ok {
		t.Errorf("Unchanged(live, another volume's snapshot) = %v, %v; want false", ok, err)
	}
	// A writable snapshot of live.
	must(t, p.Snapshot(ctx, live, "a/rw", false))
	if ok, err := p.Unchanged(live, "a/rw"); err != nil || ok {
		t.Errorf("Unchanged(live, a writable snapshot) = %v, %v; want false", ok, err)
	}
	// Dirty data in another volume of the filesystem: Unchanged cannot tell whose.
	writeAt(t, p.Path(other)+"/data.bin", 0, []byte("z"))
	if ok, err := p.Unchanged(live, snap); err != nil || ok {
		t.Errorf("Unchanged with dirty data in another volume = %v, %v; want false", ok, err)
	}
	must(t, p.Sync(ctx, other))
	if ok, err := p.Unchanged(live, snap); err != nil || !ok {
		t.Errorf("Unchanged once the other volume is written back = %v, %v; want true", ok, err)
	}
	if _, err := p.Unchanged(live, "missing"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Unchanged(live, missing) = %v; want not found", err)
	}
	if _, err := p.Unchanged("../x", snap); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("Unchanged(../x) = %v; want invalid argument", err)
	}
}

// TestRevertPlanned runs every case of TestRevert through a plan: live is changed,
// snapshotted as the base (as a checkpoint does), and reverted to the earlier snapshot
// from the base's difference, without a snapshot of live.
func TestRevertPlanned(t *testing.T) {
	requireRoot(t)
	p := openTest(t, testConfig(t, 2<<30))
	for _, how := range append(diffWays, "fixed") {
		t.Run(how, func(t *testing.T) { testRevertPlanned(t, p, how) })
	}
}

// asPublishing runs f while head is recorded as a split snapshot being published, its
// content fixed (as SnapshotSplit records it from its return until its ioctl ends): the
// pool must then read head by its tree ID. Its other operations on head would wait for
// the publication, which f's end alone brings: a wait fails the test after a minute.
func asPublishing(t *testing.T, p *Pool, head string, f func()) {
	t.Helper()
	fd, err := openVolume(p.rootfd, head)
	must(t, err)
	id, err := rootID(fd)
	unix.Close(fd)
	must(t, err)
	pub := p.pend(head)
	pub.id.Store(id)
	done := make(chan struct{})
	go func() {
		defer close(done)
		f()
	}()
	select {
	case <-done:
	case <-time.After(time.Minute):
		t.Fatalf("the pool waited for the publication of %s instead of reading its tree %d", head, id)
	}
	p.unpend(head, pub)
}

func testRevertPlanned(t *testing.T, p *Pool, how string) {
	ctx := context.Background()
	fixed, prefix := how == "fixed", how // a tree plan from a head being published
	if fixed {
		how = "tree"
	}
	checkDiff := useDiff(t, p, how)
	for i, tc := range revertCases {
		t.Run(tc.name, func(t *testing.T) {
			live, target, head := fmt.Sprintf("%s%d/live", prefix, i), fmt.Sprintf("%s%d/target", prefix, i), fmt.Sprintf("%s%d/head", prefix, i)
			must(t, p.Create(ctx, live))
			base(t, p.Path(live))
			if tc.setup != nil {
				tc.setup(t, p.Path(live))
			}
			must(t, p.Snapshot(ctx, live, target, true))
			tc.mutate(t, p.Path(live))
			must(t, p.Snapshot(ctx, live, head, true))
			var ok bool
			var pl storage.RevertPlan
			var err error
			plan := func() {
				if ok, err = p.Unchanged(live, head); err != nil || !ok {
					return
				}
				pl, err = p.PlanRevert(ctx, head, target)
			}
			if fixed {
				asPublishing(t, p, head, plan)
			} else {
				plan()
			}
			if err != nil || !ok {
				t.Fatalf("Unchanged(live, head) = %v, then PlanRevert: %v; want true, then a plan", ok, err)
			}
			before := inodes(t, p.Path(live))
			st, err := p.RevertPlanned(ctx, live, pl)
			if err != nil {
				t.Fatalf("RevertPlanned: %v", err)
			}
			t.Logf("%d operations planned; %+v", pl.Len(), st)
			checkDiff(t, st)
			checkReverted(t, p, live, target, before)
			if tc.check != nil {
				tc.check(t, st)
			}
			checkWritable(t, p, live)
			// A plain Revert afterwards keeps it so (it may set times again, and
			// recreate what was recreated, as after a Revert).
			if _, err := p.Revert(ctx, live, target); err != nil {
				t.Fatalf("Revert after RevertPlanned: %v", err)
			}
			checkReverted(t, p, live, target, before)
		})
	}
}

// TestRevertPlannedChain goes back two snapshots with two plans in a row. A file the
// first plan recreates (deleted after s1) is then updated in place by the second (it
// changed between s0 and s1): the second plan must find it as the first made it.
func TestRevertPlannedChain(t *testing.T) {
	p := newPool(t)
	ctx := context.Background()
	live, s0 := newRevertPair(t, p, "a")
	mutateMany(t, p.Path(live))
	writeAt(t, p.Path(live)+"/big.db", 0, fill(8192, 'B'))
	must(t, p.Snapshot(ctx, live, "a/s1", true))
	writeAt(t, p.Path(live)+"/home/user/notes.txt", 0, []byte("again"))
	must(t, os.RemoveAll(p.Path(live)+"/new"))
	must(t, os.Remove(p.Path(live)+"/big.db"))
	must(t, os.Remove(p.Path(live)+"/bin/tool/x"))
	writeFile(t, p.Path(live)+"/s2-only", "x")
	must(t, p.Snapshot(ctx, live, "a/s2", true))
	before := inodes(t, p.Path(live))
	p21, err := p.PlanRevert(ctx, "a/s2", "a/s1")
	must(t, err)
	p10, err := p.PlanRevert(ctx, "a/s1", s0)
	must(t, err)
	if _, err := p.RevertPlanned(ctx, live, p10, p21); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("RevertPlanned with plans out of order = %v; want invalid argument", err)
	}
	st, err := p.RevertPlanned(ctx, live, p21, p10)
	if err != nil {
		t.Fatalf("RevertPlanned(s2 -> s1 -> s0): %v", err)
	}
	checkTreeDiff(t, st.Diff, st.DiffNote, "two plans in a row")
	checkReverted(t, p, live, s0, before)
	checkWritable(t, p, live)
}

// TestRevertPlannedBadInput: a clear error, nothing changed.
func TestRevertPlannedBadInput(t *testing.T) {
	p := newPool(t)
	ctx := context.Background()
	live, snap := newRevertPair(t, p, "a")
	want := scan(t, p.Path(live))
	for _, tc := range []struct {
		name      string
		base, snp string
		class     error
	}{
		{"writable base", live, snap, errdefs.ErrFailedPrecondition},
		{"same volume", snap, snap, errdefs.ErrInvalidArgument},
		{"missing", "nope", snap, errdefs.ErrNotFound},
		{"bad name", "../x", snap, errdefs.ErrInvalidArgument},
	} {
		if _, err := p.PlanRevert(ctx, tc.base, tc.snp); !errors.Is(err, tc.class) {
			t.Errorf("%s: PlanRevert(%q, %q) = %v; want %v", tc.name, tc.base, tc.snp, err, tc.class)
		}
	}
	if _, err := p.RevertPlanned(ctx, live); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("RevertPlanned without a plan = %v; want invalid argument", err)
	}
	if _, err := p.RevertPlanned(ctx, live, foreignPlan{}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("RevertPlanned with another pool's plan = %v; want invalid argument", err)
	}
	must(t, p.Snapshot(ctx, live, "a/head", true))
	pl, err := p.PlanRevert(ctx, "a/head", snap)
	must(t, err)
	if _, err := p.RevertPlanned(ctx, "a/head", pl); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("RevertPlanned onto the plan's own base = %v; want invalid argument", err)
	}
	must(t, p.SetReadOnly(ctx, live, true))
	if _, err := p.RevertPlanned(ctx, live, pl); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("RevertPlanned onto a read-only volume = %v; want failed precondition", err)
	}
	must(t, p.SetReadOnly(ctx, live, false))
	if diff := scan(t, p.Path(live)); len(diff) != len(want) {
		t.Errorf("live changed: %d entries, want %d", len(diff), len(want))
	}
}

type foreignPlan struct{}

func (foreignPlan) Base() string     { return "x" }
func (foreignPlan) Snapshot() string { return "y" }
func (foreignPlan) Len() int         { return 0 }
func (foreignPlan) SendMS() float64  { return 0 }

var _ storage.RevertPlan = foreignPlan{}
