//go:build ha

package ha_test

import (
	"bufio"
	"context"
	"database/sql"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"os"
	"os/exec"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/advisory"
	"github.com/sqllock/sqllock/testdb/ha"
)

// Environment of the hammer's child processes (TestHelperHammer).
const (
	hammerEnv         = "SQLLOCK_HA_HAMMER"          // the child's id, 1 or 2
	hammerDriverEnv   = "SQLLOCK_HA_HAMMER_DRIVER"   // pgx or mysql
	hammerDSNEnv      = "SQLLOCK_HA_HAMMER_DSN"      // where this child connects
	hammerStratEnv    = "SQLLOCK_HA_HAMMER_STRATEGY" // a strategy, or advisory-tx
	hammerOptInEnv    = "SQLLOCK_HA_HAMMER_OPTIN"    // "1": WithGaleraSingleWriter
	hammerNameEnv     = "SQLLOCK_HA_HAMMER_NAME"     // the lock name
	hammerKeyEnv      = "SQLLOCK_HA_HAMMER_KEY"      // the counter row's key
	hammerDurationEnv = "SQLLOCK_HA_HAMMER_DURATION" // how long to hammer after GO

	// hammerDurationVar overrides the duration of each cell (default hammerDuration).
	hammerDurationVar = "SQLLOCK_TEST_HA_HAMMER_DURATION"
	hammerDuration    = 8 * time.Second
	// hammerHold is the sleep between the read and the write of the counter.
	hammerHold = time.Millisecond
)

// queryer is what the counter's read and write go through: the pool (autocommit) or
// the transaction of advisory.AcquireTx.
type queryer interface {
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
}

// bump is the critical section: a non-atomic read, sleep, write of the counter row.
func bump(ctx context.Context, q queryer, d sqllock.Dialect, key string) error {
	sel, upd := "SELECT n FROM ha_counter WHERE k = $1", "UPDATE ha_counter SET n = $1 WHERE k = $2"
	if d == sqllock.MySQL {
		sel, upd = "SELECT n FROM ha_counter WHERE k = ?", "UPDATE ha_counter SET n = ? WHERE k = ?"
	}
	var n int64
	if err := q.QueryRowContext(ctx, sel, key).Scan(&n); err != nil {
		return fmt.Errorf("read counter: %w", err)
	}
	time.Sleep(hammerHold)
	if _, err := q.ExecContext(ctx, upd, n+1, key); err != nil {
		return fmt.Errorf("write counter: %w", err)
	}
	return nil
}

// TestHelperHammer is a process of TestHammer. It prints READY when its Locker is
// built, waits for a line on stdin, then loops for the duration: Acquire, bump the
// counter, Release. It prints one "S start end" line per critical section (Unix
// nanoseconds, from the return of Acquire to the call of Release; "ok" or "fail" for
// the counter write), "E kind message" for the first errors of each kind, and
// "DONE" with the counts. An error matching ErrUnsafeDeployment ends the loop (a
// refusing Locker keeps refusing). Without the child environment it returns at once.
func TestHelperHammer(t *testing.T) {
	id := os.Getenv(hammerEnv)
	if id == "" {
		return
	}
	out := bufio.NewWriter(os.Stdout)
	fail := func(err error) {
		fmt.Fprintln(out, "FATAL", err)
		out.Flush()
		os.Exit(2)
	}
	driver, strategy := os.Getenv(hammerDriverEnv), os.Getenv(hammerStratEnv)
	name, key := os.Getenv(hammerNameEnv), os.Getenv(hammerKeyEnv)
	dur, err := time.ParseDuration(os.Getenv(hammerDurationEnv))
	if err != nil {
		fail(err)
	}
	d := sqllock.Postgres
	if driver == "mysql" {
		d = sqllock.MySQL
	}
	db, err := sql.Open(driver, os.Getenv(hammerDSNEnv))
	if err != nil {
		fail(err)
	}
	defer db.Close()
	base, noToken := strings.CutSuffix(strategy, "-notoken") // advisory-notoken: WithoutToken
	if strategy == "advisory-tx" {
		base = "advisory"
	}
	// Waiters of the row strategies in the other process poll (on MySQL, and behind
	// pgbouncer in transaction mode, where NOTIFY does not reach them): every 20 ms at
	// most, so that both processes get the lock often.
	l, err := newLocker(base, db, d, lockerOpts{singleWriter: os.Getenv(hammerOptInEnv) == "1", poll: 20 * time.Millisecond, noToken: noToken})
	if err != nil {
		fail(err)
	}
	if c, ok := l.(closer); ok {
		defer c.Close()
	}
	fmt.Println("READY")
	if _, err := bufio.NewReader(os.Stdin).ReadString('\n'); err != nil {
		fail(fmt.Errorf("waiting for GO: %w", err))
	}

	errs := map[string]int{}
	shown := map[string]int{}
	refused := 0
	note := func(where string, err error) {
		k := errKind(err)
		if where == "counter" && k != "refused" && k != "lost" {
			k = "counter" // the counter's own read or write failed (a Galera certification failure: two writers)
		}
		if k == "refused" {
			refused++
		}
		errs[k]++
		if shown[k] < 3 {
			shown[k]++
			fmt.Fprintf(out, "E %s %s: %s\n", k, where, strings.ReplaceAll(err.Error(), "\n", " "))
		}
	}
	sections, failed := 0, 0
	ctx := context.Background()
	end := time.Now().Add(dur)
	for time.Now().Before(end) && refused == 0 {
		actx, cancel := context.WithTimeout(ctx, 10*time.Second)
		var start time.Time
		var berr error
		if strategy == "advisory-tx" {
			tx, err := db.BeginTx(actx, nil)
			if err != nil {
				cancel()
				note("begin", err)
				time.Sleep(10 * time.Millisecond)
				continue
			}
			if _, err := l.(*advisory.Locker).AcquireTx(actx, tx, name); err != nil {
				tx.Rollback()
				cancel()
				note("acquire", err)
				time.Sleep(10 * time.Millisecond)
				continue
			}
			start = time.Now()
			berr = bump(actx, tx, d, key)
			stop := time.Now()
			if berr != nil {
				tx.Rollback()
			} else if err := tx.Commit(); err != nil {
				berr = fmt.Errorf("commit: %w", err)
			}
			cancel()
			if berr != nil {
				failed++
				note("counter", berr)
			} else {
				sections++
			}
			fmt.Fprintf(out, "S %d %d %s\n", start.UnixNano(), stop.UnixNano(), okFail(berr))
			think()
			continue
		}
		lease, err := l.Acquire(actx, name)
		cancel()
		if err != nil {
			note("acquire", err)
			time.Sleep(10 * time.Millisecond)
			continue
		}
		start = time.Now()
		bctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		berr = bump(bctx, db, d, key)
		cancel()
		stop := time.Now()
		if berr != nil {
			failed++
			note("counter", berr)
		} else {
			sections++
		}
		fmt.Fprintf(out, "S %d %d %s\n", start.UnixNano(), stop.UnixNano(), okFail(berr))
		if err := lease.Err(); err != nil {
			note("lease", err)
		}
		rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		if err := lease.Release(rctx); err != nil {
			note("release", err)
		}
		cancel()
		think()
	}
	kinds := slices.Sorted(maps.Keys(errs))
	var b strings.Builder
	for _, k := range kinds {
		fmt.Fprintf(&b, "%s:%d,", k, errs[k])
	}
	fmt.Fprintf(out, "DONE %d %d %d %s\n", sections, failed, refused, strings.TrimSuffix(b.String(), ","))
	out.Flush()
}

// think pauses between a release and the next acquisition, for 0 to 3 ms: without
// it the releasing process takes the lock again before the other process's next poll
// (the row strategies are FIFO within a process only), and one process may starve.
func think() { time.Sleep(time.Duration(rand.Int64N(int64(3 * time.Millisecond)))) }

func okFail(err error) string {
	if err != nil {
		return "fail"
	}
	return "ok"
}

// hammerChild is one process of a cell, seen from TestHammer.
type hammerChild struct {
	cmd              *exec.Cmd
	stdin            io.WriteCloser
	ready, done      chan struct{}
	intervals        [][2]int64
	sections, failed int
	refused          int
	errs             map[string]int
	lines            []string // E and FATAL lines
	gotDone          bool
}

func startHammerChild(t *testing.T, id int, driver, dsn, strategy string, optIn bool, name, key string, dur time.Duration) *hammerChild {
	t.Helper()
	c := &hammerChild{ready: make(chan struct{}), done: make(chan struct{}), errs: map[string]int{}}
	c.cmd = exec.Command(os.Args[0], "-test.run=^TestHelperHammer$", "-test.count=1")
	opt := "0"
	if optIn {
		opt = "1"
	}
	c.cmd.Env = append(os.Environ(), hammerEnv+"="+strconv.Itoa(id), hammerDriverEnv+"="+driver,
		hammerDSNEnv+"="+dsn, hammerStratEnv+"="+strategy, hammerOptInEnv+"="+opt,
		hammerNameEnv+"="+name, hammerKeyEnv+"="+key, hammerDurationEnv+"="+dur.String())
	c.cmd.Stderr = os.Stderr
	var err error
	if c.stdin, err = c.cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	out, err := c.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := c.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		defer close(c.done)
		sc := bufio.NewScanner(out)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		readied := false
		for sc.Scan() {
			line := sc.Text()
			f := strings.Fields(line)
			if len(f) == 0 {
				continue
			}
			switch f[0] {
			case "READY":
				if !readied {
					readied = true
					close(c.ready)
				}
			case "S":
				if len(f) >= 3 {
					a, _ := strconv.ParseInt(f[1], 10, 64)
					b, _ := strconv.ParseInt(f[2], 10, 64)
					c.intervals = append(c.intervals, [2]int64{a, b})
				}
			case "E", "FATAL":
				c.lines = append(c.lines, line)
			case "DONE":
				if len(f) >= 4 {
					c.gotDone = true
					c.sections, _ = strconv.Atoi(f[1])
					c.failed, _ = strconv.Atoi(f[2])
					c.refused, _ = strconv.Atoi(f[3])
					if len(f) >= 5 {
						for _, kv := range strings.Split(f[4], ",") {
							k, v, _ := strings.Cut(kv, ":")
							n, _ := strconv.Atoi(v)
							c.errs[k] += n
						}
					}
				}
			}
		}
		io.Copy(io.Discard, out)
	}()
	t.Cleanup(func() {
		c.stdin.Close()
		c.cmd.Process.Kill()
		<-c.done
		c.cmd.Wait()
	})
	return c
}

// overlaps counts the critical sections of a and of b that intersect a section of
// the other process: both believed they held the lock at once.
func overlaps(a, b [][2]int64) int {
	count := func(x, y [][2]int64) int {
		// y sorted by start; prefix maximum of ends.
		sort.Slice(y, func(i, j int) bool { return y[i][0] < y[j][0] })
		maxEnd := make([]int64, len(y))
		for i, iv := range y {
			maxEnd[i] = iv[1]
			if i > 0 && maxEnd[i-1] > iv[1] {
				maxEnd[i] = maxEnd[i-1]
			}
		}
		n := 0
		for _, iv := range x {
			// sections of y that start before iv ends; one of them ending after iv
			// starts overlaps iv.
			k := sort.Search(len(y), func(i int) bool { return y[i][0] >= iv[1] })
			if k > 0 && maxEnd[k-1] > iv[0] {
				n++
			}
		}
		return n
	}
	return count(a, b) + count(b, a)
}

// hammerCell is one strategy on one topology.
type hammerCell struct {
	strategy string // a strategy, advisory-tx (advisory.AcquireTx) or advisory-notoken (WithoutToken)
	optIn    bool   // with WithGaleraSingleWriter
	expect   string // "safe", "refused" or "measured" (logged only)
	clean    bool   // safe, and no Acquire or Release may fail either
}

func (c hammerCell) label() string {
	if c.optIn {
		return c.strategy + "+singlewriter"
	}
	return c.strategy
}

// hammerTopology is where the two processes connect.
type hammerTopology struct {
	name   string
	driver string
	dsn    [2]string // process 1, process 2
	db     *sql.DB   // the counter's database, for setting up and reading it
	dbNode *sql.DB   // where process 2 reads (Galera node 2), to wait for the counter row
	cells  []hammerCell
}

// TestHammer: two OS processes (this test binary run again) hammer one lock name per
// strategy and topology for a few seconds, each critical section a non-atomic read,
// sleep, write of a counter row. Lost updates (sum of sections less the final
// counter) and overlapping sections (by the processes' own clocks, one host) show
// whether two processes held the lock at once. Safe cells must show none, and
// sections by both processes; refused cells must refuse (ErrUnsafeDeployment). The
// refused strategies also run on Galera with WithGaleraSingleWriter while the
// processes break that promise (two nodes): their overlaps are the measurement of
// why they are refused, logged only. One line per cell:
//
//	HAMMER strategy=... topology=... sections=... lost=... overlaps=... refused=... errors=...
func TestHammer(t *testing.T) {
	lab := ha.Start(t)
	dur := hammerDuration
	if v := os.Getenv(hammerDurationVar); v != "" {
		var err error
		if dur, err = time.ParseDuration(v); err != nil {
			t.Fatalf("%s: %v", hammerDurationVar, err)
		}
	}
	pg := postgresPair(t, lab, "sync", false)
	g1, g2 := galera(t, lab, 1), galera(t, lab, 2)
	txDSN, sessDSN := lab.BouncerDSN("transaction"), lab.BouncerDSN("session")
	primary := lab.PrimaryDSN()

	safe := func(ss ...string) []hammerCell {
		var cs []hammerCell
		for _, s := range ss {
			cs = append(cs, hammerCell{strategy: s, expect: "safe"})
		}
		return cs
	}
	rows := []string{"uniqueindex", "optimistic", "fairqueue"}
	all := append(slices.Clone(rows), "forupdate", "advisory")
	topologies := []hammerTopology{
		{name: "galera", driver: "mysql", dsn: [2]string{lab.GaleraDSN(1), lab.GaleraDSN(2)}, db: g1, dbNode: g2,
			cells: append(safe(rows...),
				hammerCell{strategy: "forupdate", expect: "refused"},
				hammerCell{strategy: "advisory", expect: "refused"},
				hammerCell{strategy: "forupdate", optIn: true, expect: "measured"},
				hammerCell{strategy: "advisory", optIn: true, expect: "measured"})},
		{name: "pg-sync", driver: "pgx", dsn: [2]string{primary, primary}, db: pg, cells: safe(all...)},
		{name: "pgbouncer-transaction", driver: "pgx", dsn: [2]string{txDSN, txDSN}, db: pg,
			cells: append(safe("uniqueindex", "optimistic", "fairqueue", "forupdate", "advisory-tx"),
				hammerCell{strategy: "advisory", expect: "refused"})},
		{name: "pgbouncer-session", driver: "pgx", dsn: [2]string{sessDSN, sessDSN}, db: pg, cells: safe(all...)},
	}
	t0 := time.Now()
	var mu sync.Mutex
	var summary []string
	// The topologies at once (go test -parallel would allow only GOMAXPROCS of them),
	// the cells of one topology one after the other.
	var wg sync.WaitGroup
	for _, top := range topologies {
		wg.Go(func() {
			t.Run(top.name, func(t *testing.T) {
				for _, c := range top.cells {
					t.Run(c.label(), func(t *testing.T) {
						line := runHammerCell(t, top, c, dur)
						mu.Lock()
						summary = append(summary, line)
						mu.Unlock()
					})
				}
			})
		})
	}
	wg.Wait()
	sort.Strings(summary)
	t.Logf("hammer: %d cells of %v each in %v:\n%s", len(summary), dur, time.Since(t0).Round(time.Second), strings.Join(summary, "\n"))
}

func runHammerCell(t *testing.T, top hammerTopology, c hammerCell, dur time.Duration) string {
	ctx := ctxFor(t, dur+2*time.Minute)
	ph := "$1"
	if top.driver == "mysql" {
		ph = "?"
	}
	stamp := time.Now().UnixNano()
	name := fmt.Sprintf("ha-hammer/%s/%s/%d", top.name, c.label(), stamp)
	key := name
	if _, err := top.db.ExecContext(ctx, "INSERT INTO ha_counter (k, n) VALUES ("+ph+", 0)", key); err != nil {
		t.Fatalf("counter row: %v", err)
	}
	if top.dbNode != nil { // Galera: the row must have reached node 2 before process 2 reads it
		for {
			var n int64
			err := top.dbNode.QueryRowContext(ctx, "SELECT n FROM ha_counter WHERE k = ?", key).Scan(&n)
			if err == nil {
				break
			}
			select {
			case <-ctx.Done():
				t.Fatalf("counter row on node 2: %v", err)
			case <-time.After(20 * time.Millisecond):
			}
		}
	}
	var cs [2]*hammerChild
	for i := range cs {
		cs[i] = startHammerChild(t, i+1, top.driver, top.dsn[i], c.strategy, c.optIn, name, key, dur)
	}
	for i, ch := range cs {
		select {
		case <-ch.ready:
		case <-ch.done:
			t.Fatalf("process %d ended before READY: %v", i+1, ch.lines)
		case <-ctx.Done():
			t.Fatalf("process %d not READY", i+1)
		}
	}
	for _, ch := range cs {
		io.WriteString(ch.stdin, "GO\n")
	}
	for i, ch := range cs {
		select {
		case <-ch.done:
		case <-ctx.Done():
			t.Fatalf("process %d did not finish", i+1)
		}
		if err := ch.cmd.Wait(); err != nil || !ch.gotDone {
			t.Errorf("process %d: exit %v, DONE line %v: %v", i+1, err, ch.gotDone, ch.lines)
		}
		for _, l := range ch.lines {
			t.Logf("process %d: %s", i+1, l)
		}
	}
	var final int64
	q := "SELECT n FROM ha_counter WHERE k = " + ph
	if err := top.db.QueryRowContext(ctx, q, key).Scan(&final); err != nil {
		t.Fatalf("final counter: %v", err)
	}
	sections := cs[0].sections + cs[1].sections
	lost := int64(sections) - final
	ov := overlaps(cs[0].intervals, cs[1].intervals)
	refused := cs[0].refused + cs[1].refused
	errs := map[string]int{}
	for _, ch := range cs {
		for k, n := range ch.errs {
			errs[k] += n
		}
	}
	es := "none"
	if len(errs) > 0 {
		var b []string
		for _, k := range slices.Sorted(maps.Keys(errs)) {
			b = append(b, fmt.Sprintf("%s:%d", k, errs[k]))
		}
		es = strings.Join(b, ",")
	}
	leaked := ""
	if c.strategy == "advisory" && top.driver == "pgx" {
		// Both processes are gone: no server session may still hold their lock (behind
		// pgbouncer in transaction mode it would, until pgbouncer closes the session).
		n := advisoryHeld(t, top.db, name)
		leaked = fmt.Sprintf(" leaked=%d", n)
		if n != 0 {
			t.Errorf("%d server sessions still hold the advisory lock after both processes exited", n)
		}
	}
	line := fmt.Sprintf("HAMMER strategy=%s topology=%s sections=%d (p1=%d p2=%d) lost=%d overlaps=%d refused=%d errors=%s%s expect=%s",
		c.label(), top.name, sections, cs[0].sections, cs[1].sections, lost, ov, refused, es, leaked, c.expect)
	t.Log(line)

	switch c.expect {
	case "safe":
		if lost != 0 || ov != 0 {
			t.Errorf("mutual exclusion violated: %d lost updates, %d overlapping sections", lost, ov)
		}
		if cs[0].sections == 0 || cs[1].sections == 0 {
			t.Errorf("sections by process 1: %d, by process 2: %d; want some by both", cs[0].sections, cs[1].sections)
		}
		if refused != 0 {
			t.Errorf("refused %d times; want no refusal here", refused)
		}
		if c.clean && len(errs) > 0 {
			t.Errorf("errors %s; want none: a conflict the server resolved must be waited out, not returned", es)
		}
	case "refused":
		if refused == 0 {
			t.Errorf("no refusal (ErrUnsafeDeployment) in %v: the strategy ran on an unsafe deployment (%d lost updates, %d overlapping sections)", dur, lost, ov)
		}
	case "measured":
		// Unsafe by design here, but what the library returns is still its promise:
		// forupdate's COMMIT that certification (Galera, a group) fails is ErrLost, and
		// no error reaches the caller raw (README: "A deadlock or certification failure
		// at COMMIT is ErrLost").
		if n := errs["other"] + errs["bare"]; c.strategy == "forupdate" && n != 0 {
			t.Errorf("%d errors without a sentinel kind (%s): a certification failure must be reported as ErrLost", n, es)
		}
	}
	return line
}

// advisoryHeld counts the PostgreSQL sessions that hold the advisory lock of name
// (pg_locks, the two-int4 key form), polling for up to 5 s for it to become 0 (the
// backends of processes that just exited end a moment later).
func advisoryHeld(t *testing.T, db *sql.DB, name string) int {
	t.Helper()
	l, err := advisory.New(db, sqllock.Postgres)
	if err != nil {
		t.Fatalf("advisory.New: %v", err)
	}
	defer l.Close()
	k1, k2 := l.PostgresKeys(name)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var n int
	err = pollUntil(ctx, func() (bool, error) {
		err := db.QueryRowContext(ctx, `SELECT count(*) FROM pg_locks
  WHERE locktype = 'advisory' AND granted AND objsubid = 2 AND classid::bigint = $1 AND objid::bigint = $2`,
			int64(uint32(k1)), int64(uint32(k2))).Scan(&n)
		return err == nil && n == 0, err
	})
	if err != nil && n == 0 {
		t.Fatalf("pg_locks: %v", err)
	}
	return n
}
