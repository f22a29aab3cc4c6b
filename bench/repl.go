package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"github.com/cairn-sandbox/cairn/errdefs"
)

// replTimeout bounds the wait for one answer of the REPL.
const replTimeout = 30 * time.Second

// transport carries text to a Python REPL's stdin and reads its stdout.
type transport interface {
	// write sends data to the REPL's stdin.
	write(ctx context.Context, data []byte) error
	// output returns the REPL's stdout from byte offset off on, and the offset after it.
	output(ctx context.Context, off int64) ([]byte, int64, error)
}

// repl drives a `python3 -i -u` through a transport. Every request runs one statement
// and evaluates one expression inside the helper __b (defined by replHelper), which
// prints the result between markers numbered by seq; the driver polls stdout for them.
type repl struct {
	t   transport
	off int64 // stdout offset after the last answer read
	seq int
}

// replHelper defines __b(n, stmt, expr): it runs stmt, evaluates expr and prints the
// result (or the exception) between the markers of request n.
const replHelper = "def __b(n, s, e):\n" +
	" try:\n" +
	"  exec(s, globals())\n" +
	"  v = eval(e, globals()) if e else ''\n" +
	" except BaseException as x:\n" +
	"  v = 'ERR:' + repr(x)\n" +
	" print('<<%d>>' % n + str(v) + '<</%d>>' % n)\n"

// pyString quotes s as a Python string literal (a JSON string is one).
func pyString(s string) string {
	b, _ := json.Marshal(s)
	return string(b)
}

// start defines the helper in a fresh REPL.
func (r *repl) start(ctx context.Context) error {
	if err := r.t.write(ctx, []byte("exec("+pyString(replHelper)+")\n")); err != nil {
		return err
	}
	_, err := r.eval(ctx, "", "1")
	return err
}

// eval runs stmt, then returns str(eval(expr)) ("" for no expr).
func (r *repl) eval(ctx context.Context, stmt, expr string) (string, error) {
	r.seq++
	n := r.seq
	req := fmt.Sprintf("__b(%d, %s, %s)\n", n, pyString(stmt), pyString(expr))
	if err := r.t.write(ctx, []byte(req)); err != nil {
		return "", err
	}
	open, closing := fmt.Sprintf("<<%d>>", n), fmt.Sprintf("<</%d>>", n)
	var buf []byte
	off := r.off
	deadline := time.Now().Add(replTimeout)
	for delay := 200 * time.Microsecond; ; delay = min(2*delay, 20*time.Millisecond) {
		b, next, err := r.t.output(ctx, off)
		if err != nil {
			return "", err
		}
		buf, off = append(buf, b...), next
		if j := strings.Index(string(buf), closing); j >= 0 {
			i := strings.Index(string(buf), open)
			if i < 0 || i > j {
				return "", fmt.Errorf("repl: garbled answer %q", buf)
			}
			end := j + len(closing)
			if end < len(buf) && buf[end] == '\n' {
				end++
			}
			r.off = off - int64(len(buf)-end)
			v := string(buf[i+len(open) : j])
			if strings.HasPrefix(v, "ERR:") {
				return "", fmt.Errorf("repl: %s raised %s", stmt+expr, v[4:])
			}
			return v, nil
		}
		if time.Now().After(deadline) {
			return "", errdefs.Unavailable("repl: no answer to request %d in %s (output so far %q)", n, replTimeout, tail(buf, 200))
		}
		select {
		case <-ctx.Done():
			return "", ctx.Err()
		case <-time.After(delay):
		}
	}
}

func tail(b []byte, n int) string {
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}

// W1's REPL state: a ~40 MB dict of 300k str→str entries, a list that each step grows
// by 1 MiB, a sqlite3 connection with 10,000 committed rows and an open transaction
// holding uncommitted rows, and a generator suspended mid-iteration (gn is the value it
// last yielded).
var replSetup = []string{
	`import os, sqlite3`,
	`d = {"k%06d" % i: "%012d" % i for i in range(300000)}`,
	`L = []`,
	`con = sqlite3.connect(DB, isolation_level=None); cur = con.cursor()`,
	`cur.execute("create table if not exists t(id integer primary key, name text, body text)")`,
	`cur.execute("BEGIN"); cur.executemany("insert into t(name, body) values (?, ?)", (("n%d" % i, "b" * 64) for i in range(10000))); cur.execute("COMMIT")`,
	`cur.execute("BEGIN"); cur.execute("insert into t(name, body) values ('uncommitted', 'x')")`,
	`g = iter(range(10**9)); gn = next(g)`,
}

// rowBytes is the payload of one inserted row (name + 64-byte body), for the step's
// changed-bytes estimate.
const rowBytes = 72

// heapBytes is what one step's REPL statement adds to the heap: a 1 MiB str.
const heapBytes = 1 << 20

// setupW1 builds W1's REPL state, with the database at dbPath.
func (r *repl) setupW1(ctx context.Context, dbPath string) error {
	if err := r.start(ctx); err != nil {
		return err
	}
	if _, err := r.eval(ctx, "DB = "+pyString(dbPath), ""); err != nil {
		return err
	}
	for _, s := range replSetup {
		if _, err := r.eval(ctx, s, ""); err != nil {
			return err
		}
	}
	return nil
}

// step runs the REPL half of step n: one statement changing ~1 MiB of heap (and adding
// one dict entry, advancing the generator), then one statement inserting 10 rows into
// the open transaction.
func (r *repl) step(ctx context.Context, n int) error {
	if _, err := r.eval(ctx, fmt.Sprintf(`L.append(os.urandom(%d).hex()); d["step%d"] = "s"; gn = next(g)`, heapBytes/2, n), ""); err != nil {
		return err
	}
	_, err := r.eval(ctx, fmt.Sprintf(`cur.executemany("insert into t(name, body) values (?, ?)", [("s%d-%%d" %% i, "b" * 64) for i in range(10)])`, n), "")
	return err
}

// replState is what the correctness checks compare.
type replState struct {
	DictLen int `json:"dict_len"`
	Gen     int `json:"gen"`  // the value the generator last yielded
	Rows    int `json:"rows"` // rows visible to the REPL's connection (uncommitted included)
}

const stateExpr = `"%d %d %d" % (len(d), gn, cur.execute("select count(*) from t").fetchone()[0])`

func parseState(s string) (replState, error) {
	var st replState
	if _, err := fmt.Sscanf(s, "%d %d %d", &st.DictLen, &st.Gen, &st.Rows); err != nil {
		return st, fmt.Errorf("repl state %q: %w", s, err)
	}
	return st, nil
}

// probe reads the REPL's state without changing it.
func (r *repl) probe(ctx context.Context) (replState, error) {
	s, err := r.eval(ctx, "", stateExpr)
	if err != nil {
		return replState{}, err
	}
	return parseState(s)
}

// verify checks the REPL against the state probed at a checkpoint: same dict size and
// row count, and the generator yields the value after the one it had yielded then. It
// advances the generator (gn) by one, which later steps build on.
func (r *repl) verify(ctx context.Context, want replState) error {
	s, err := r.eval(ctx, "gn = next(g)", stateExpr)
	if err != nil {
		return err
	}
	got, err := parseState(s)
	if err != nil {
		return err
	}
	want.Gen++
	if got != want {
		return fmt.Errorf("repl state %+v, want %+v", got, want)
	}
	return nil
}
