package criu_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/cairn-sandbox/cairn/criu"
	"github.com/cairn-sandbox/cairn/internal/testenv"
)

// TestWorker dumps a real process through a CRIU worker started ahead, and checks the
// cases where the worker cannot serve: started for another network namespace path, or
// dead before the dump (a worker whose program exits at once). Each dump must still
// succeed, through a CRIU started for it.
func TestWorker(t *testing.T) {
	pid, netns := sleeper(t)

	dump := func(t *testing.T, w *criu.Worker) {
		t.Helper()
		dir := t.TempDir()
		if err := criu.Dump(context.Background(), criu.DumpOptions{Pid: pid, ImagesDir: dir, NetNS: netns, Worker: w}); err != nil {
			t.Fatalf("dump: %v", err)
		}
		if _, err := os.Stat(filepath.Join(dir, fmt.Sprintf("core-%d.img", pid))); err != nil {
			t.Fatalf("dump wrote no core image: %v", err)
		}
	}
	t.Run("Ahead", func(t *testing.T) {
		w, err := criu.StartWorker(netns)
		if err != nil {
			t.Fatal(err)
		}
		dump(t, w)
		w.Close() // again: a no-op
	})
	t.Run("OtherNamespace", func(t *testing.T) {
		w, err := criu.StartWorker("/proc/self/ns/net")
		if err != nil {
			t.Fatal(err)
		}
		dump(t, w)
	})
	t.Run("DeadWorker", func(t *testing.T) {
		w, err := criu.StartWorkerWith("/bin/true", netns)
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(200 * time.Millisecond) // for it to be gone, as a worker that died long ago
		dump(t, w)
	})
	t.Run("Unused", func(t *testing.T) {
		w, err := criu.StartWorker(netns)
		if err != nil {
			t.Fatal(err)
		}
		w.Close() // CRIU exits when its socket closes; Close waits for it
	})
}

// BenchmarkDump measures a dump of a small process with a CRIU started for it and with
// a worker started ahead (its start untimed): the difference is CRIU's start-up, which
// a checkpoint no longer waits for inside the freeze.
//
//	go test ./criu -run '^$' -bench Dump -benchtime 20x
func BenchmarkDump(b *testing.B) {
	pid, netns := sleeper(b)
	for _, ahead := range []bool{false, true} {
		b.Run(map[bool]string{false: "Fresh", true: "Worker"}[ahead], func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				dir := b.TempDir()
				var w *criu.Worker
				if ahead {
					var err error
					if w, err = criu.StartWorker(netns); err != nil {
						b.Fatal(err)
					}
					time.Sleep(50 * time.Millisecond) // started, as after a checkpoint's step
				}
				b.StartTimer()
				if err := criu.Dump(context.Background(), criu.DumpOptions{Pid: pid, ImagesDir: dir, NetNS: netns, Worker: w}); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// sleeper starts a process to dump (a session leader, as CRIU wants a tree's root
// without --shell-job) and returns its PID and network namespace path.
func sleeper(tb testing.TB) (int, string) {
	testenv.Require(tb)
	cmd := exec.Command("sleep", "600")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	return cmd.Process.Pid, fmt.Sprintf("/proc/%d/ns/net", cmd.Process.Pid)
}

// TestRestoreWorker dumps a real process, kills it and restores it three times: with a
// restore worker started ahead, with one that died before the restore, and with none.
// Each restore must bring the process back, in a network namespace of its own.
func TestRestoreWorker(t *testing.T) {
	for _, tc := range []struct {
		name   string
		worker func() (*criu.Worker, error)
	}{
		{"Ahead", func() (*criu.Worker, error) { return criu.StartRestoreWorker(false) }},
		{"DeadWorker", func() (*criu.Worker, error) { return criu.StartRestoreWorkerWith("/bin/true", false) }},
		{"None", func() (*criu.Worker, error) { return nil, nil }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pid, netns := sleeper(t)
			dir := t.TempDir()
			if err := criu.Dump(context.Background(), criu.DumpOptions{Pid: pid, ImagesDir: dir, NetNS: netns}); err != nil {
				t.Fatalf("dump: %v", err)
			}
			before, err := os.Readlink(netns)
			if err != nil {
				t.Fatal(err)
			}
			p, _ := os.FindProcess(pid)
			p.Kill()
			p.Wait()
			w, err := tc.worker()
			if err != nil {
				t.Fatal(err)
			}
			time.Sleep(200 * time.Millisecond) // a dead worker is gone, a live one started
			got, err := criu.Restore(context.Background(), criu.RestoreOptions{ImagesDir: dir, WorkDir: t.TempDir(), Root: "/", Worker: w})
			if err != nil {
				t.Fatalf("restore: %v", err)
			}
			t.Cleanup(func() { syscall.Kill(got, syscall.SIGKILL) })
			if got != pid {
				t.Fatalf("restored PID %d, want %d", got, pid)
			}
			ns, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/net", got))
			if err != nil {
				t.Fatal(err)
			}
			if ns == before {
				t.Fatalf("restored into the dumped process's network namespace %s, want a new one", ns)
			}
		})
	}
}
