package btrfs

import (
	"context"
	"crypto/sha256"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/storage"
)

// TestSnapshotSplit checks the premise of SnapshotSplit (fixed.go): once it returns, no
// write to the source reaches the snapshot. Each round changes the source in every way
// a sandbox does (data through write and through a shared mapping, a create, an
// unlink, a rename, a truncate, a directory), splits a snapshot, changes it again at
// once, while the snapshot's commit is still going on, and then compares the published
// snapshot with what the source held at the split.
func TestSnapshotSplit(t *testing.T) {
	p := newPool(t)
	ctx := context.Background()
	must(t, p.Create(ctx, "split/live"))
	l := p.Path("split/live")
	must(t, os.MkdirAll(l+"/d", 0o755))
	must(t, os.WriteFile(l+"/big", nil, 0o644))
	mapped := l + "/mapped"
	must(t, os.WriteFile(mapped, make([]byte, 1<<20), 0o644))
	mf, err := os.OpenFile(mapped, os.O_RDWR, 0)
	must(t, err)
	defer mf.Close()
	mem, err := unix.Mmap(int(mf.Fd()), 0, 1<<20, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	must(t, err)
	defer unix.Munmap(mem)

	change := func(k int) {
		writeFile(t, fmt.Sprintf("%s/d/f%d", l, k%7), strings.Repeat(fmt.Sprint(k), 3000))
		writeAt(t, l+"/big", int64(k%16)*65536, fill(8192, byte('a'+k%26)))
		copy(mem[(k%64)*4096:], fmt.Sprintf("page %d", k))
		writeFile(t, fmt.Sprintf("%s/new%d", l, k), "new")
		os.Remove(fmt.Sprintf("%s/new%d", l, k-2))
		os.Rename(fmt.Sprintf("%s/d/f%d", l, (k+3)%7), fmt.Sprintf("%s/d/r%d", l, k))
		must(t, os.Truncate(l+"/big", int64(1<<20+k*1000)))
		must(t, os.MkdirAll(fmt.Sprintf("%s/dir%d", l, k), 0o755))
	}
	early := 0
	const rounds = 30
	for k := range rounds {
		change(2 * k)
		want := treeOf(t, l)
		dst := fmt.Sprintf("split/s%d", k)
		published, err := p.SnapshotSplit(ctx, "split/live", dst, true)
		must(t, err)
		if _, err := os.Lstat(filepath.Join(p.Root(), dst)); err != nil {
			early++ // returned before the snapshot's ioctl did
		}
		// A plan from the snapshot while it is being published reads its fixed tree by
		// its ID, and must be the plan made once it is published.
		var during storage.RevertPlan
		if k > 0 {
			during, err = p.PlanRevert(ctx, dst, fmt.Sprintf("split/s%d", k-1))
			must(t, err)
		}
		change(2*k + 1)
		if k%2 == 0 && !p.Exists(dst) { // the pool's own operations wait for it
			t.Fatalf("round %d: Exists(%s) false while the snapshot was being published", k, dst)
		}
		must(t, published())
		if got := treeOf(t, p.Path(dst)); got != want {
			t.Fatalf("round %d: the snapshot holds writes made after SnapshotSplit returned:\n got %.400s\nwant %.400s", k, got, want)
		}
		if during != nil {
			after, err := p.PlanRevert(ctx, dst, fmt.Sprintf("split/s%d", k-1))
			must(t, err)
			if during.Len() != after.Len() {
				t.Fatalf("round %d: the plan from the snapshot being published has %d commands, %d once published", k, during.Len(), after.Len())
			}
		}
	}
	// Not a timing bound: the snapshot is fixed ~1 ms into a ~5 ms ioctl here, and the
	// watch polls every 0.1 ms; a split that never returned early tests nothing.
	if early == 0 {
		t.Fatalf("SnapshotSplit returned after the snapshot was published in all %d rounds: the watch for its root reference never saw it", rounds)
	}
	t.Logf("%d of %d splits returned before the snapshot's commit was done", early, rounds)

	// A name taken fails, and leaves the volume there alone.
	if published, err := p.SnapshotSplit(ctx, "split/live", "split/s0", true); err == nil {
		err = published()
		if err == nil {
			t.Fatal("SnapshotSplit onto an existing volume succeeded")
		}
	}
	if !p.Exists("split/s0") {
		t.Fatal("SnapshotSplit onto an existing volume removed it")
	}
}

// treeOf describes every entry below dir: path, type, size and content.
func treeOf(t *testing.T, dir string) string {
	t.Helper()
	var b strings.Builder
	must(t, filepath.Walk(dir, func(path string, fi os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, path)
		fmt.Fprintf(&b, "%s %v %d", rel, fi.Mode().Type(), fi.Size())
		if fi.Mode().IsRegular() {
			data, err := os.ReadFile(path)
			if err != nil {
				return err
			}
			fmt.Fprintf(&b, " %x", sha256.Sum256(data))
		}
		b.WriteByte('\n')
		return nil
	}))
	return b.String()
}

// TestRootItemInfo reads a snapshot's root item by its tree ID and finds what the
// kernel's GET_SUBVOL_INFO says of it: the offsets of rootItemInfo are right.
func TestRootItemInfo(t *testing.T) {
	p := newPool(t)
	ctx := context.Background()
	must(t, p.Create(ctx, "info/live"))
	writeFile(t, p.Path("info/live")+"/f", "x")
	must(t, p.Snapshot(ctx, "info/live", "info/snap", true))
	fd, err := openVolume(p.rootfd, "info/snap")
	must(t, err)
	defer unix.Close(fd)
	want, err := subvolInfo(fd)
	must(t, err)
	got, err := rootItemInfo(p.rootfd, want.treeID)
	must(t, err)
	if got.generation != want.generation || got.flags != want.flags || got.uuid != want.uuid || got.parentUUID != want.parentUUID ||
		got.ctransid != want.ctransid || got.otransid != want.otransid {
		t.Fatalf("root item of tree %d: %+v; GET_SUBVOL_INFO: %+v", want.treeID, got, want)
	}
	if got.flags&rootSubvolRdonly == 0 || got.uuid == [16]byte{} || got.parentUUID == [16]byte{} {
		t.Fatalf("root item of a read-only snapshot: flags %#x, uuid %x, parent %x", got.flags, got.uuid, got.parentUUID)
	}
	if _, err := rootItemInfo(p.rootfd, 1<<40); err == nil {
		t.Fatal("rootItemInfo of a tree that does not exist succeeded")
	}
}
