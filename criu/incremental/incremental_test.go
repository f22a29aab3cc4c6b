package incremental

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/criu"
)

// The tests dump a real two-process Python tree holding 64 MiB with CRIU, rewrite the
// images with this package, restore them with CRIU and compare the restored processes'
// memory (each writes a SHA-256 of its buffer on SIGUSR1) with what was dumped.

const holder = `
import hashlib, os, signal, sys, time
out, size = sys.argv[1], int(sys.argv[2])
buf = bytearray(size)
for i in range(0, size, 4096):
    buf[i:i+8] = i.to_bytes(8, 'little')
    buf[i+8:i+16] = b'cairnpat'
gen = [0]
def checksum(sig, frm):
    p = '%s.sum-%d' % (out, os.getpid())
    with open(p + '.tmp', 'w') as f:
        f.write(hashlib.sha256(buf).hexdigest())
    os.rename(p + '.tmp', p)
def change(sig, frm):
    # ~1 MiB of scattered pages, at a place that differs per process and generation,
    # once per generation asked for (the signal is repeated if it seems lost).
    with open(out + '.want') as f:
        want = int(f.read())
    if gen[0] < want:
        gen[0] = want
        base = ((gen[0] * 3 + os.getpid() % 5) << 20) % (size - (2 << 20))
        for i in range(base, base + (2 << 20), 8192):
            buf[i+100:i+108] = b'gen%05d' % gen[0]
    open('%s.changed-%d-%d' % (out, os.getpid(), gen[0]), 'w').close()
signal.signal(signal.SIGUSR1, checksum)
signal.signal(signal.SIGUSR2, change)
child = os.fork()
if child:
    with open(out + '.child', 'w') as f:
        f.write(str(child))
    open(out + '.ready', 'w').close()
while True:
    time.sleep(3600)
`

const holdBytes = 64 << 20

func TestMain(m *testing.M) {
	if op := os.Getenv("CAIRN_INCR_HELPER"); op != "" {
		// Re-executed by a crash test: run one rewrite (which the crash point kills).
		args := strings.Split(op, ":")
		var err error
		switch args[0] {
		case "compact":
			_, err = Compact(args[1], args[2], Options{})
		case "flatten":
			_, err = Flatten(args[1], Options{})
		case "rebase":
			_, err = Rebase(args[1], Options{})
		case "share":
			_, err = Share(args[1], args[2], ShareOptions{})
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	// Restored trees are orphaned when criu restore -d exits: adopt them, to reap them.
	unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
	os.Exit(m.Run())
}

func needCRIU(t *testing.T) string {
	t.Helper()
	skip := t.Skipf
	if os.Getenv("CI") == "true" {
		skip = t.Fatalf
	}
	if os.Geteuid() != 0 {
		skip("needs root (CRIU)")
	}
	p, err := criu.Find()
	if err != nil {
		skip("%v", err)
	}
	if _, err := exec.LookPath("python3"); err != nil {
		skip("needs python3 for the process under test")
	}
	return p
}

// tree is the process tree under test: a Python parent and its forked child.
type tree struct {
	t    testing.TB
	out  string // prefix of the files the processes write
	pids []int  // parent, child
}

func startTree(t testing.TB, dir string) *tree {
	script := filepath.Join(dir, "hold.py")
	if err := os.WriteFile(script, []byte(holder), 0o600); err != nil {
		t.Fatal(err)
	}
	tr := &tree{t: t, out: filepath.Join(dir, "hold")}
	cmd := exec.Command("python3", script, tr.out, strconv.Itoa(holdBytes))
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go cmd.Wait()
	tr.pids = []int{cmd.Process.Pid}
	waitFile(t, tr.out+".ready")
	b, err := os.ReadFile(tr.out + ".child")
	if err != nil {
		t.Fatal(err)
	}
	child, _ := strconv.Atoi(string(b))
	tr.pids = append(tr.pids, child)
	t.Cleanup(tr.kill)
	return tr
}

func waitFile(t testing.TB, path string) {
	t.Helper()
	for i := 0; i < 3000; i++ {
		if _, err := os.Stat(path); err == nil {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("%s did not appear", path)
}

// change makes every process of the tree rewrite ~1 MiB of its buffer, as generation
// gen (1, 2, ...). The signal is repeated until the answer comes, as in sums: one sent
// while CRIU still holds the tree (just after a dump that leaves it running, or a
// restore) can be lost; the generation asked for is in a file, so a repeated signal
// changes nothing twice.
func (tr *tree) change(gen int) {
	if err := os.WriteFile(tr.out+".want", []byte(strconv.Itoa(gen)), 0o600); err != nil {
		tr.t.Fatal(err)
	}
	for _, p := range tr.pids {
		f := fmt.Sprintf("%s.changed-%d-%d", tr.out, p, gen)
		answered := false
		for i := 0; i < 60 && !answered; i++ {
			if err := syscall.Kill(p, syscall.SIGUSR2); err != nil {
				tr.t.Fatalf("signal %d: %v", p, err)
			}
			for j := 0; j < 100 && !answered; j++ {
				_, err := os.Stat(f)
				answered = err == nil
				time.Sleep(5 * time.Millisecond)
			}
		}
		if !answered {
			st, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", p))
			tr.t.Fatalf("process %d does not answer: %s", p, st)
		}
	}
}

// sums returns each process's checksum of its buffer. The signal is repeated until the
// answer comes: one sent while CRIU is still finishing a restore can be lost.
func (tr *tree) sums() []string {
	var out []string
	for _, p := range tr.pids {
		f := fmt.Sprintf("%s.sum-%d", tr.out, p)
		os.Remove(f)
		var b []byte
		for i := 0; i < 60 && b == nil; i++ {
			if err := syscall.Kill(p, syscall.SIGUSR1); err != nil {
				tr.t.Fatalf("signal %d: %v", p, err)
			}
			for j := 0; j < 100 && b == nil; j++ {
				b, _ = os.ReadFile(f)
				time.Sleep(5 * time.Millisecond)
			}
		}
		if b == nil {
			st, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", p))
			tr.t.Fatalf("process %d does not answer: %s", p, st)
		}
		out = append(out, string(b))
	}
	return out
}

// kill kills the tree and reaps it (the test is the subreaper of restored trees), so
// its PIDs are free for the next restore.
func (tr *tree) kill() {
	for _, p := range tr.pids {
		syscall.Kill(p, syscall.SIGKILL)
	}
	for _, p := range tr.pids {
		for i := 0; i < 500; i++ {
			var ws unix.WaitStatus
			unix.Wait4(p, &ws, unix.WNOHANG, nil)
			if _, err := os.Stat(fmt.Sprintf("/proc/%d", p)); errors.Is(err, os.ErrNotExist) {
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
}

func dump(t testing.TB, criuPath string, tr *tree, dir string) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(criuPath, "dump", "-t", strconv.Itoa(tr.pids[0]), "-D", dir, "--leave-running",
		"-o", "dump.log", "-v2").CombinedOutput()
	if err != nil {
		log, _ := os.ReadFile(filepath.Join(dir, "dump.log"))
		t.Fatalf("criu dump: %v: %s\n%s", err, out, log)
	}
	os.Remove(filepath.Join(dir, "dump.log"))
}

// restore restores the tree from dir (the old one must be dead) and checks the memory
// of every restored process against want.
func restore(t *testing.T, criuPath string, tr *tree, dir string, want []string) {
	t.Helper()
	tr.kill()
	log := filepath.Join(t.TempDir(), "restore.log")
	out, err := exec.Command(criuPath, "restore", "-d", "-D", dir, "-o", log, "-v2").CombinedOutput()
	if err != nil {
		b, _ := os.ReadFile(log)
		t.Fatalf("criu restore from %s: %v: %s\n%s", dir, err, out, b)
	}
	if d := cmp.Diff(want, tr.sums()); d != "" {
		t.Fatalf("memory restored from %s differs from what was dumped (-want +got):\n%s", dir, d)
	}
}

// imagesDir returns a fresh directory for images (and the tree's files).
func imagesDir(t *testing.T) string { return t.TempDir() }

func dirBytes(t *testing.T, dir string) int64 {
	var n int64
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if fi, err := e.Info(); err == nil && fi.Mode().IsRegular() {
			n += fi.Size()
		}
	}
	return n
}

// checkClean asserts that dir has no temporary file and no pages file no pagemap names.
func checkClean(t *testing.T, dir string) {
	t.Helper()
	ents, _ := os.ReadDir(dir)
	used := map[uint32]bool{}
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), "pagemap-") && strings.HasSuffix(e.Name(), ".img") {
			id, _, err := readPagemap(filepath.Join(dir, e.Name()))
			if err != nil {
				t.Fatal(err)
			}
			used[id] = true
		}
	}
	if l, err := Leftovers(dir); err != nil || len(l) > 0 {
		t.Errorf("%s: Leftovers says %v, %v", dir, l, err)
	}
	for _, e := range ents {
		if strings.HasSuffix(e.Name(), tmpSuffix) {
			t.Errorf("%s: leftover %s", dir, e.Name())
		}
		if id, ok := pagesID(e.Name()); ok && !used[id] {
			t.Errorf("%s: orphan %s", dir, e.Name())
		}
	}
}

// threeDumps starts the tree in base and dumps it three times, into c1, c2 and c3, with
// a change before each of the last two; s2 and s3 are the memory they hold.
func threeDumps(t *testing.T, criuPath, base string) (tr *tree, d1, d2, d3 string, s2, s3 []string) {
	t.Helper()
	tr = startTree(t, base)
	d1, d2, d3 = filepath.Join(base, "c1"), filepath.Join(base, "c2"), filepath.Join(base, "c3")
	dump(t, criuPath, tr, d1)
	tr.change(1)
	s2 = tr.sums()
	dump(t, criuPath, tr, d2)
	tr.change(2)
	s3 = tr.sums()
	dump(t, criuPath, tr, d3)
	return tr, d1, d2, d3, s2, s3
}

func TestChain(t *testing.T) {
	criuPath := needCRIU(t)
	tr, d1, d2, d3, s2, s3 := threeDumps(t, criuPath, imagesDir(t))
	full := dirBytes(t, d2)

	res, err := Compact(d2, d1, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Compact(d3, d2, Options{}); err != nil {
		t.Fatal(err)
	}
	small := dirBytes(t, d2)
	t.Logf("c2: %d bytes full, %d incremental (%d tasks, %d pages shared, %d own)", full, small, res.Tasks, res.SharedPages, res.OwnPages)
	if res.Tasks != 2 || small > full/8 {
		t.Fatalf("c2 after compaction: %d tasks rewritten, %d of %d bytes left; want 2 tasks, under 1/8", res.Tasks, small, full)
	}
	for dir, want := range map[string]int{d1: 0, d2: 1, d3: 2} {
		if got, err := Depth(dir); err != nil || got != want {
			t.Fatalf("Depth(%s) = %d, %v; want %d", dir, got, err, want)
		}
	}
	if p, err := Parent(d3); err != nil || p != d2 {
		t.Fatalf("Parent(c3) = %q, %v; want %q", p, err, d2)
	}
	if l, _ := os.Readlink(filepath.Join(d3, ParentLink)); l != "../c2" {
		t.Fatalf("c3's parent link is %q, want the relative ../c2", l)
	}
	checkClean(t, d2)
	checkClean(t, d3)

	restore(t, criuPath, tr, d3, s3)
	restore(t, criuPath, tr, d2, s2)

	// Take c2 out of c3's chain, delete it: c3 still restores, through c1.
	if _, err := Rebase(d3, Options{}); err != nil {
		t.Fatal(err)
	}
	if p, _ := Parent(d3); p != d1 {
		t.Fatalf("after Rebase, c3's parent is %q, want %q", p, d1)
	}
	os.RemoveAll(d2)
	checkClean(t, d3)
	restore(t, criuPath, tr, d3, s3)

	// Flatten c3, delete c1: c3 is full again.
	if _, err := Flatten(d3, Options{}); err != nil {
		t.Fatal(err)
	}
	if p, _ := Parent(d3); p != "" {
		t.Fatalf("after Flatten, c3 still has parent %q", p)
	}
	os.RemoveAll(d1)
	checkClean(t, d3)
	restore(t, criuPath, tr, d3, s3)
}

// TestCrash kills a rewrite at each of its crash points and checks that the directory,
// once swept, restores the dumped memory, and that running the rewrite again completes.
// twoDumps starts the tree in base and dumps it twice, into c1 and c2, with a change
// in between; s2 is the memory c2 holds.
func twoDumps(t *testing.T, criuPath, base string) (tr *tree, d1, d2 string, s2 []string) {
	t.Helper()
	tr = startTree(t, base)
	d1, d2 = filepath.Join(base, "c1"), filepath.Join(base, "c2")
	dump(t, criuPath, tr, d1)
	tr.change(1)
	s2 = tr.sums()
	dump(t, criuPath, tr, d2)
	return tr, d1, d2, s2
}

// crash runs the rewrite op ("compact:DIR:PARENT", "flatten:DIR", ...) in a child
// process killed at the crash point at, and checks that it died there, leaving files
// to sweep (every crash point follows a write).
func crash(t *testing.T, at, op string) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "CAIRN_INCR_HELPER="+op, "CAIRN_TEST_CRASH_AT="+at)
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
		t.Fatalf("%s at %s: want a SIGKILL, got %v: %s", op, at, err, out)
	}
	dir := strings.Split(op, ":")[1]
	if l, err := Leftovers(dir); err != nil || len(l) == 0 {
		t.Fatalf("%s at %s: Leftovers says %v, %v; want the crash's files", op, at, l, err)
	}
}

func TestCrash(t *testing.T) {
	criuPath := needCRIU(t)
	base := imagesDir(t)
	tr, d1, d2, s2 := twoDumps(t, criuPath, base)
	copyDir := func(name, from string) string {
		to := filepath.Join(base, name)
		if out, err := exec.Command("cp", "-a", from, to).CombinedOutput(); err != nil {
			t.Fatalf("cp: %v: %s", err, out)
		}
		return to
	}
	for i, at := range []string{"incremental-pages", "incremental-pagemap", "incremental-link", "incremental-switch"} {
		t.Run("compact/"+at, func(t *testing.T) {
			d := copyDir(fmt.Sprintf("compact%d", i), d2)
			crash(t, at, "compact:"+d+":"+d1)
			if err := Sweep(d); err != nil {
				t.Fatal(err)
			}
			checkClean(t, d)
			restore(t, criuPath, tr, d, s2)
			if _, err := Compact(d, d1, Options{}); err != nil {
				t.Fatal(err)
			}
			checkClean(t, d)
			if dirBytes(t, d) > dirBytes(t, d2)/8 {
				t.Fatalf("resumed compaction left %d bytes", dirBytes(t, d))
			}
			restore(t, criuPath, tr, d, s2)
		})
	}
	inc := copyDir("inc", d2)
	if _, err := Compact(inc, d1, Options{}); err != nil {
		t.Fatal(err)
	}
	for i, at := range []string{"incremental-switch", "incremental-unlink"} {
		t.Run("flatten/"+at, func(t *testing.T) {
			d := copyDir(fmt.Sprintf("flatten%d", i), inc)
			crash(t, at, "flatten:"+d)
			if err := Sweep(d); err != nil {
				t.Fatal(err)
			}
			checkClean(t, d)
			restore(t, criuPath, tr, d, s2)
			if _, err := Flatten(d, Options{}); err != nil {
				t.Fatal(err)
			}
			if p, _ := Parent(d); p != "" {
				t.Fatalf("flattened directory still has parent %s", p)
			}
			restore(t, criuPath, tr, d, s2)
		})
	}
}

// BenchmarkRestoreDepth measures a CRIU restore of the test tree from a full directory
// and from incremental ones at growing chain depths (each level one ~1 MiB change per
// process): the cost MaxDepth bounds.
func BenchmarkRestoreDepth(b *testing.B) {
	criuPath, err := criu.Find()
	if err != nil || os.Geteuid() != 0 {
		b.Skip("needs root and CRIU")
	}
	base := b.TempDir()
	tr := startTree(b, base)
	var dirs []string
	for k := 0; k <= MaxDepth; k++ {
		d := filepath.Join(base, fmt.Sprintf("c%d", k))
		if k > 0 {
			tr.change(k)
		}
		dump(b, criuPath, tr, d)
		if k > 0 {
			if _, err := Compact(d, dirs[k-1], Options{}); err != nil {
				b.Fatal(err)
			}
		}
		dirs = append(dirs, d)
	}
	// The full directory of the last state, for the depth-0 baseline.
	full := filepath.Join(base, "full")
	dump(b, criuPath, tr, full)
	for _, depth := range []int{0, 1, 2, 4, MaxDepth} {
		dir := dirs[depth]
		if depth == 0 {
			dir = full
		}
		b.Run(fmt.Sprintf("depth=%d", depth), func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				tr.kill()
				b.StartTimer()
				if out, err := exec.Command(criuPath, "restore", "-d", "-D", dir).CombinedOutput(); err != nil {
					b.Fatalf("restore: %v: %s", err, out)
				}
			}
		})
	}
}
