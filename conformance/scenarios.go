package conformance

import (
	"context"
	"fmt"
	"math/rand"
	"strings"
	"testing"
	"time"

	"github.com/cairn-sandbox/cairn/engine/model"
	"github.com/cairn-sandbox/cairn/errdefs"
)

func testREPLRollback(t *testing.T, h Harness) {
	id, p := replSandbox(t, h)
	ask(t, h, id, p, "x = 41")
	sh(t, h, id, "echo one > /workspace/note")
	c1 := checkpoint(t, h, id, "before")
	ask(t, h, id, p, "x += 1")
	want(t, "x before rollback", ask(t, h, id, p, "print(x)"), "42")
	sh(t, h, id, "rm -rf /etc/apt && echo two > /workspace/note && touch /workspace/new")
	rollback(t, h, id, c1)
	want(t, "x after rollback", ask(t, h, id, p, "print(x)"), "41")
	want(t, "note after rollback", sh(t, h, id, "cat /workspace/note"), "one\n")
	want(t, "/etc/apt after rollback", sh(t, h, id, "test -d /etc/apt && echo yes"), "yes\n")
	want(t, "new file after rollback", sh(t, h, id, "test -e /workspace/new && echo yes || echo no"), "no\n")
	// The REPL keeps working from the restored state, and a second rollback to the same
	// checkpoint works as well.
	ask(t, h, id, p, "x *= 2")
	want(t, "x after more work", ask(t, h, id, p, "print(x)"), "82")
	rollback(t, h, id, c1)
	want(t, "x after second rollback", ask(t, h, id, p, "print(x)"), "41")
}

func testSQLite(t *testing.T, h Harness) {
	id, p := replSandbox(t, h)
	ask(t, h, id, p, `import sqlite3
db = sqlite3.connect("/workspace/db.sqlite", isolation_level=None)
db.execute("create table t(i integer)")
db.executemany("insert into t values(?)", [(i,) for i in range(100)])
db.execute("begin")
db.executemany("insert into t values(?)", [(i,) for i in range(100, 150)])`)
	want(t, "rows in open transaction", ask(t, h, id, p, `print(db.execute("select count(*) from t").fetchone()[0], db.in_transaction)`), "150 True")
	ck := checkpoint(t, h, id, "open-tx")
	ask(t, h, id, p, `db.execute("commit"); db.execute("delete from t where i < 50")`)
	want(t, "rows after commit", ask(t, h, id, p, `print(db.execute("select count(*) from t").fetchone()[0])`), "100")
	rollback(t, h, id, ck)
	want(t, "after rollback", ask(t, h, id, p, `print(db.execute("select count(*) from t").fetchone()[0], db.in_transaction)`), "150 True")
	// Another connection sees only the committed rows (the transaction is still open and
	// holds its lock), and committing the restored transaction persists it.
	want(t, "committed rows seen from outside", sh(t, h, id, `sqlite3 /workspace/db.sqlite 'select count(*) from t' 2>&1 || true`), "100\n")
	ask(t, h, id, p, `db.execute("commit")`)
	want(t, "after commit", sh(t, h, id, `sqlite3 /workspace/db.sqlite 'select count(*) from t'`), "150\n")
}

func testLoopback(t *testing.T, h Harness) {
	id, srv := replSandbox(t, h)
	cli := spawn(t, h, id, "python3", "-i", "-u")
	ask(t, h, id, srv, `import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 9000)); s.listen()`)
	ask(t, h, id, cli, `import socket
c = socket.create_connection(("127.0.0.1", 9000))`)
	ask(t, h, id, srv, `conn, _ = s.accept()`)
	talk := func(msg string) {
		t.Helper()
		ask(t, h, id, cli, fmt.Sprintf("c.sendall(b%q)", msg+"\n"))
		want(t, "server got", ask(t, h, id, srv, `print(conn.recv(100).decode().strip())`), msg)
		ask(t, h, id, srv, fmt.Sprintf("conn.sendall(b%q)", "ack-"+msg+"\n"))
		want(t, "client got", ask(t, h, id, cli, `print(c.recv(100).decode().strip())`), "ack-"+msg)
	}
	talk("hello")
	ck := checkpoint(t, h, id, "connected")
	talk("after-checkpoint")
	rollback(t, h, id, ck)
	talk("after-rollback")
	// The listening socket still accepts new clients.
	want(t, "new client", sh(t, h, id, `python3 -c 'import socket; socket.create_connection(("127.0.0.1", 9000)); print("ok")'`), "ok\n")
}

func testThreads(t *testing.T, h Harness) {
	id, p := replSandbox(t, h)
	ask(t, h, id, p, `import threading, time
counts = [0] * 4
ev = threading.Event()
def work(i):
    while True:
        counts[i] += 1
        time.sleep(0.001)

ts = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(4)]
waiter = threading.Thread(target=ev.wait, daemon=True)
for th in ts + [waiter]: th.start()`)
	ck := checkpoint(t, h, id, "threads")
	check := func(id string) {
		t.Helper()
		ask(t, h, id, p, `before = list(counts); time.sleep(0.3)`)
		want(t, "threads alive and counting", ask(t, h, id, p, `print(threading.active_count(), all(a > b for a, b in zip(counts, before)))`), "6 True")
		// The thread blocked in a futex wakes up when told to.
		want(t, "blocked thread wakes", ask(t, h, id, p, `ev.set(); waiter.join(5); print(waiter.is_alive())`), "False")
	}
	rollback(t, h, id, ck)
	check(id)
	for _, f := range fork(t, h, ck, 2) {
		check(f)
	}
}

func testForkDiverges(t *testing.T, h Harness) {
	id, p := replSandbox(t, h)
	ask(t, h, id, p, `import socket; seen = []`)
	sh(t, h, id, "echo origin > /workspace/ids")
	ck := checkpoint(t, h, id, "pre-fork")
	forks := fork(t, h, ck, 8)
	machineIDs := map[string]bool{}
	for _, f := range forks {
		sh(t, h, f, "hostname >> /workspace/ids")
		ask(t, h, f, p, `seen.append(socket.gethostname())`)
	}
	for _, f := range forks {
		want(t, "fork "+f+" file", sh(t, h, f, "cat /workspace/ids"), "origin\n"+f+"\n")
		want(t, "fork "+f+" REPL", ask(t, h, f, p, `print(seen)`), fmt.Sprintf("['%s']", f))
		machineIDs[sh(t, h, f, "cat /etc/machine-id")] = true
	}
	if len(machineIDs) != len(forks) {
		t.Fatalf("forks share machine-ids: %d distinct for %d forks", len(machineIDs), len(forks))
	}
	want(t, "origin file", sh(t, h, id, "cat /workspace/ids"), "origin\n")
	want(t, "origin REPL", ask(t, h, id, p, `print(seen)`), "[]")
}

func testRandomRollbacks(t *testing.T, h Harness) {
	id, p := replSandbox(t, h)
	ask(t, h, id, p, "x = 0; g = iter(range(10**9))")
	var cks []string
	for i := 0; i < 20; i++ {
		ask(t, h, id, p, fmt.Sprintf("x = %d; next(g)", i))
		sh(t, h, id, fmt.Sprintf("echo %d > /workspace/state && mkdir -p /workspace/d%d", i, i))
		cks = append(cks, checkpoint(t, h, id, fmt.Sprint(i)))
	}
	rng := rand.New(rand.NewSource(time.Now().UnixNano()))
	for n := 0; n < 10; n++ {
		i := rng.Intn(len(cks))
		rollback(t, h, id, cks[i])
		want(t, fmt.Sprintf("x at checkpoint %d", i), ask(t, h, id, p, "print(x, next(g))"), fmt.Sprintf("%d %d", i, i+1))
		want(t, fmt.Sprintf("file at checkpoint %d", i), sh(t, h, id, "cat /workspace/state; ls -d /workspace/d* | wc -l"), fmt.Sprintf("%d\n%d\n", i, i+1))
		// Diverge a little before the next jump, so the tree branches.
		ask(t, h, id, p, "x = -1")
	}
	tree, err := h.Engine.Tree(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	if len(tree) != 20 {
		t.Fatalf("tree has %d checkpoints, want 20", len(tree))
	}
}

func testPty(t *testing.T, h Harness) {
	id := sandbox(t, h)
	ctx := context.Background()
	p, err := h.Engine.Exec(ctx, id, model.ExecOptions{Args: []string{"bash", "--norc", "-i"}, Tty: true, Env: []string{"PS1=$ "}})
	if err != nil {
		t.Fatal(err)
	}
	send := func(line string) {
		if err := h.Engine.Stdin(ctx, id, p, []byte(line+"\n"), false); err != nil {
			t.Fatal(err)
		}
	}
	waitFor := func(s string) {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for time.Now().Before(deadline) {
			out, _, _ := h.Engine.Output(ctx, id, p, "stdout", 0)
			if strings.Contains(string(out), s) {
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
		out, _, _ := h.Engine.Output(ctx, id, p, "stdout", 0)
		t.Fatalf("pty output never contained %q: %q", s, tail(string(out), 400))
	}
	send("tty; export V=first; echo v=$V")
	waitFor("/dev/pts/")
	waitFor("v=first")
	ck := checkpoint(t, h, id, "pty")
	send("export V=second")
	rollback(t, h, id, ck)
	send("echo after=$V")
	waitFor("after=first")
}

// testProcessRecords removes process records: refused while the process runs, gone
// once removed, and brought back by a rollback to a checkpoint that has it (records are
// part of the root).
func testProcessRecords(t *testing.T, h Harness, id string) {
	ctx := context.Background()
	p, err := h.Engine.Exec(ctx, id, model.ExecOptions{Args: []string{"sleep", "1000"}})
	if err != nil {
		t.Fatal(err)
	}
	if err := h.Engine.RemoveProcess(ctx, id, p); errdefs.Code(err) != "failed_precondition" {
		t.Fatalf("remove the record of a running process: %v, want failed_precondition", err)
	}
	if pr, err := h.Engine.Process(ctx, id, p); err != nil || !pr.Running {
		t.Fatalf("running process after a refused removal: %+v %v", pr, err)
	}
	if err := h.Engine.Signal(ctx, id, p, 9); err != nil {
		t.Fatal(err)
	}
	if _, err := h.Engine.Wait(ctx, id, p); err != nil {
		t.Fatal(err)
	}
	ck := checkpoint(t, h, id, "with a record")
	if err := h.Engine.RemoveProcess(ctx, id, p); err != nil {
		t.Fatalf("remove the record of an exited process: %v", err)
	}
	if _, err := h.Engine.Process(ctx, id, p); !errorsIsNotFound(err) {
		t.Fatalf("process after its removal: %v, want not_found", err)
	}
	list, err := h.Engine.Processes(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	for _, pr := range list {
		if pr.Handle == p {
			t.Fatalf("removed process %s still listed", p)
		}
	}
	if err := h.Engine.RemoveProcess(ctx, id, p); !errorsIsNotFound(err) {
		t.Fatalf("second removal: %v, want not_found", err)
	}
	if err := h.Engine.RemoveProcess(ctx, id, "../etc"); errdefs.Code(err) != "invalid_argument" {
		t.Fatalf("removal of a bad handle: %v, want invalid_argument", err)
	}
	rollback(t, h, id, ck)
	if pr, err := h.Engine.Process(ctx, id, p); err != nil || pr.Exit == nil || pr.Exit.Signal != 9 {
		t.Fatalf("record after a rollback to a checkpoint that has it: %+v %v", pr, err)
	}
}

func testExec(t *testing.T, h Harness) {
	id := sandbox(t, h)
	code, out, errOut := run(t, h, id, "sh", "-c", "echo out; echo err >&2; exit 7")
	if code != 7 || out != "out\n" || errOut != "err\n" {
		t.Fatalf("exit %d stdout %q stderr %q, want 7 out err", code, out, errOut)
	}
	ctx := context.Background()
	p, err := h.Engine.Exec(ctx, id, model.ExecOptions{Args: []string{"sh", "-c", "echo $FOO; pwd"}, Env: []string{"FOO=bar"}, Cwd: "/workspace", NoStdin: true})
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	if _, err := h.Engine.Follow(ctx, id, p, &b, nil); err != nil {
		t.Fatal(err)
	}
	want(t, "env and cwd", b.String(), "bar\n/workspace\n")
	if _, err := h.Engine.Exec(ctx, id, model.ExecOptions{Args: []string{"no-such-command"}}); err == nil {
		t.Fatal("exec of a missing command succeeded")
	}
	// A long-running process can be signalled; its exit reports the signal.
	p, err = h.Engine.Exec(ctx, id, model.ExecOptions{Args: []string{"sleep", "1000"}})
	if err != nil {
		t.Fatal(err)
	}
	if err := h.Engine.Signal(ctx, id, p, 15); err != nil {
		t.Fatal(err)
	}
	st, err := h.Engine.Wait(ctx, id, p)
	if err != nil || st.Signal != 15 {
		t.Fatalf("signalled process: %+v %v", st, err)
	}
	testProcessRecords(t, h, id)
	// No egress: only loopback exists.
	want(t, "interfaces", sh(t, h, id, "ls /sys/class/net 2>/dev/null || cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' '"), "lo\n")
	want(t, "hostname", sh(t, h, id, "hostname"), id+"\n")
}
