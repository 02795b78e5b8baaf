package main

import (
	"context"
	"database/sql"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/url"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/moby/moby/api/types/network"
	"github.com/testcontainers/testcontainers-go"
	tclog "github.com/testcontainers/testcontainers-go/log"
	tcpostgres "github.com/testcontainers/testcontainers-go/modules/postgres"
	"github.com/testcontainers/testcontainers-go/wait"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/advisory"
	"github.com/sqllock/sqllock/fairqueue"
	"github.com/sqllock/sqllock/forupdate"
	"github.com/sqllock/sqllock/migrations"
	"github.com/sqllock/sqllock/optimistic"
	"github.com/sqllock/sqllock/uniqueindex"
)

const demoUsage = `usage: sqllock demo [-dsn DSN] [-strategy uniqueindex|optimistic|fairqueue|forupdate|advisory]
                    [-replicas 3] [-duration 10s] [-job 200ms] [-name NAME] [--no-tty] [-image postgres:17]
Runs N replicas (goroutines, each with its own pool and Locker) that compete for one
scheduled job lock, and shows who holds it, the token, the waiters and the hand-offs.
It checks that no two replicas hold the lock at once and that tokens increase, and
exits non-zero if not. Without -dsn or SQLLOCK_DSN it starts PostgreSQL in a
container (testcontainers, Docker).`

var demoStrategies = []string{"uniqueindex", "optimistic", "fairqueue", "forupdate", "advisory"}

type demoLocker interface {
	sqllock.Locker
	Close() error
}

// newDemoLocker makes a Locker of strategy on db, with timings for a demo: a 6 s TTL
// (a dead replica's lock frees quickly) and quick polls.
func newDemoLocker(strategy string, db *sql.DB, d sqllock.Dialect) (demoLocker, error) {
	const ttl, ka, poll = 6 * time.Second, 2 * time.Second, 50 * time.Millisecond
	switch strategy {
	case "uniqueindex":
		return uniqueindex.New(db, d, uniqueindex.WithTTL(ttl), uniqueindex.WithKeepalive(ka), uniqueindex.WithPollInterval(poll))
	case "optimistic":
		return optimistic.New(db, d, optimistic.WithTTL(ttl), optimistic.WithKeepalive(ka), optimistic.WithPollInterval(poll))
	case "fairqueue":
		return fairqueue.New(db, d, fairqueue.WithTTL(ttl), fairqueue.WithKeepalive(ka), fairqueue.WithPollInterval(poll))
	case "forupdate":
		return forupdate.New(db, d, forupdate.WithTTL(ttl), forupdate.WithKeepalive(ka))
	case "advisory":
		return advisory.New(db, d, advisory.WithTTL(ttl), advisory.WithKeepalive(ka))
	}
	return nil, fmt.Errorf("unknown strategy %q (want one of %s)", strategy, strings.Join(demoStrategies, ", "))
}

func demo(ctx context.Context, args []string, dsn string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&dsn, "dsn", dsn, "database DSN (default $SQLLOCK_DSN; none: a PostgreSQL container)")
	strategy := fs.String("strategy", "uniqueindex", "uniqueindex, optimistic, fairqueue, forupdate or advisory")
	replicas := fs.Int("replicas", 3, "number of replicas")
	duration := fs.Duration("duration", 10*time.Second, "how long the demo runs")
	job := fs.Duration("job", 200*time.Millisecond, "how long the job holds the lock")
	name := fs.String("name", "sqllock-demo/job", "the lock name")
	noTTY := fs.Bool("no-tty", false, "print plain lines (the default when stdout is not a terminal)")
	image := fs.String("image", "postgres:17", "the image of the container started without -dsn")
	fs.Usage = func() { fmt.Fprintln(stderr, demoUsage) }
	if err := fs.Parse(args); err != nil {
		return parseErr(err) // Parse printed the usage
	}
	if fs.NArg() > 0 || *replicas < 1 || *duration <= 0 || *job <= 0 {
		fs.Usage()
		return errUsage
	}
	if !slices.Contains(demoStrategies, *strategy) {
		return fmt.Errorf("demo: unknown strategy %q (want one of %s)", *strategy, strings.Join(demoStrategies, ", "))
	}
	if err := sqllock.ValidateName(*name); err != nil {
		return err
	}
	tty := !*noTTY && isTTY(stdout)
	source := "-dsn"
	if dsn == "" {
		fmt.Fprintf(stdout, "demo: no -dsn or SQLLOCK_DSN: starting PostgreSQL (%s) in a container with testcontainers (Docker)...\n", *image)
		var stop func()
		var err error
		dsn, stop, err = demoContainer(ctx, *image)
		if err != nil {
			return err
		}
		defer stop()
		source = "a container, removed at the end"
	}
	admin, err := sql.Open(driverFor(dsn), dsn)
	if err != nil {
		return err
	}
	defer admin.Close()
	d, err := sqllock.DetectDialect(ctx, admin)
	if err != nil {
		return fmt.Errorf("demo: cannot reach the database: %w", err)
	}
	if err := migrations.Up(ctx, admin, d); err != nil {
		return fmt.Errorf("demo: migrations: %w", err)
	}
	st := &demoState{out: stdout, tty: tty, n: *replicas, states: make([]string, *replicas+1), holders: map[int]sqllock.Lease{},
		header: fmt.Sprintf("sqllock demo: %d replicas, strategy %s on %s (%s), job %v, lock %q", *replicas, *strategy, d, source, *job, *name)}
	if !tty {
		fmt.Fprintln(stdout, st.header)
	}
	type replica struct {
		db *sql.DB
		l  demoLocker
	}
	rs := make([]replica, *replicas+1)
	defer func() {
		for _, r := range rs {
			if r.l != nil {
				r.l.Close()
			}
			if r.db != nil {
				r.db.Close()
			}
		}
	}()
	for i := 1; i <= *replicas; i++ {
		db, err := sql.Open(driverFor(dsn), dsn)
		if err != nil {
			return err
		}
		rs[i].db = db
		if rs[i].l, err = newDemoLocker(*strategy, db, d); err != nil {
			return err
		}
		st.states[i] = "starting"
	}
	rctx, cancel := context.WithTimeout(ctx, *duration)
	defer cancel()
	st.start = time.Now()
	st.end = st.start.Add(*duration)
	drawDone := make(chan struct{})
	if tty {
		go func() {
			defer close(drawDone)
			t := time.NewTicker(100 * time.Millisecond)
			defer t.Stop()
			for {
				st.draw()
				select {
				case <-rctx.Done():
					return
				case <-t.C:
				}
			}
		}()
	} else {
		close(drawDone)
	}
	var wg sync.WaitGroup
	for i := 1; i <= *replicas; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			st.run(rctx, i, rs[i].l, *name, *job)
		}()
	}
	wg.Wait()
	<-drawDone
	if tty {
		st.draw()
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	yes := "yes"
	if !st.tokensOK {
		yes = "no"
	}
	fmt.Fprintf(stdout, "demo: %d hand-offs, tokens increasing: %s, overlaps: %d (%d acquisitions, %d losses, %d errors)\n",
		st.handoffs, yes, st.overlaps, st.acquisitions, st.losses, st.errors)
	switch {
	case st.overlaps > 0:
		return fmt.Errorf("demo: %d overlaps: two replicas held the lock at once", st.overlaps)
	case st.acquisitions == 0 && st.firstErr != nil:
		return fmt.Errorf("demo: no replica acquired the lock: %w", st.firstErr)
	case st.acquisitions == 0:
		return errors.New("demo: no replica acquired the lock")
	case !st.tokensOK:
		return errors.New("demo: a token was not greater than the one before it")
	}
	return nil
}

// demoState is the demo's own bookkeeping: who holds the lock by the replicas'
// account, from which overlaps, hand-offs and token order are checked.
type demoState struct {
	mu           sync.Mutex
	out          io.Writer
	tty          bool
	header       string
	n            int
	start, end   time.Time
	states       []string // per replica, for the terminal view
	holders      map[int]sqllock.Lease
	waiting      int
	lastHolder   int
	releasedAt   time.Time
	lastToken    int64
	tokensOK     bool
	acquisitions int
	handoffs     int
	overlaps     int
	losses       int
	errors       int
	firstErr     error    // the first acquisition error
	events       []string // the last events, for the terminal view
}

// logf records an event: printed at once without a terminal, kept for the view with one.
func (s *demoState) logf(format string, a ...any) {
	line := fmt.Sprintf(format, a...)
	if !s.tty {
		fmt.Fprintln(s.out, line)
		return
	}
	s.events = append(s.events, line)
	if len(s.events) > 12 {
		s.events = s.events[len(s.events)-12:]
	}
}

func (s *demoState) t() string { return fmt.Sprintf("t=%.2fs", time.Since(s.start).Seconds()) }

func (s *demoState) run(ctx context.Context, r int, l sqllock.Locker, name string, job time.Duration) {
	for ctx.Err() == nil {
		s.mu.Lock()
		s.waiting++
		s.states[r] = "waiting"
		s.mu.Unlock()
		lease, err := l.Acquire(ctx, name)
		s.mu.Lock()
		s.waiting--
		s.mu.Unlock()
		if err != nil {
			if ctx.Err() != nil {
				break
			}
			s.mu.Lock()
			s.errors++
			if s.firstErr == nil {
				s.firstErr = err
			}
			s.states[r] = "error"
			s.logf("%s replica=%d error: %v", s.t(), r, err)
			s.mu.Unlock()
			sleepCtx(ctx, job)
			continue
		}
		s.acquired(r, lease)
		select {
		case <-time.After(job):
		case <-lease.Done():
		case <-ctx.Done():
		}
		s.released(r, lease)
		rctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_ = lease.Release(rctx) // an ErrLost here was reported above
		cancel()
		// A scheduled job runs once per period: rest before competing again, so that
		// the others get their turn.
		s.mu.Lock()
		s.states[r] = "resting"
		s.mu.Unlock()
		sleepCtx(ctx, job/2+rand.N(job/2+1))
	}
	s.mu.Lock()
	s.states[r] = "stopped"
	s.mu.Unlock()
}

func sleepCtx(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}

func (s *demoState) acquired(r int, lease sqllock.Lease) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for other, ol := range s.holders {
		// A holder whose lease is lost (Err reports it, by its local deadline too) no
		// longer counts: the library tells it before anyone else can acquire.
		if ol.Err() == nil {
			s.overlaps++
			s.logf("%s OVERLAP: replica=%d acquired while replica=%d holds token=%d", s.t(), r, other, ol.Token())
		}
	}
	tok := lease.Token()
	if s.acquisitions > 0 && tok <= s.lastToken {
		s.tokensOK = false
		s.logf("%s TOKEN NOT INCREASING: replica=%d token=%d after %d", s.t(), r, tok, s.lastToken)
	}
	if s.acquisitions == 0 {
		s.tokensOK = true
	}
	s.acquisitions++
	s.lastToken = tok
	s.holders[r] = lease
	s.states[r] = fmt.Sprintf("HOLDS token=%d", tok)
	s.logf("%s replica=%d acquired token=%d waiters=%d", s.t(), r, tok, s.waiting)
	if s.lastHolder != 0 && s.lastHolder != r {
		s.handoffs++
		s.logf("handoff from=%d to=%d after=%v", s.lastHolder, r, time.Since(s.releasedAt).Round(100*time.Microsecond))
	}
}

func (s *demoState) released(r int, lease sqllock.Lease) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.holders, r)
	s.lastHolder, s.releasedAt = r, time.Now()
	if err := lease.Err(); err != nil {
		s.losses++
		s.logf("%s replica=%d lost token=%d: %v", s.t(), r, lease.Token(), err)
		return
	}
	s.logf("%s replica=%d released token=%d", s.t(), r, lease.Token())
}

// draw redraws the terminal view.
func (s *demoState) draw() {
	s.mu.Lock()
	defer s.mu.Unlock()
	var b strings.Builder
	b.WriteString("\x1b[H\x1b[2J")
	b.WriteString(s.header + "\n")
	left := time.Until(s.end).Round(100 * time.Millisecond)
	fmt.Fprintf(&b, "%s, %v left; Ctrl-C stops\n\n", s.t(), max(left, 0))
	for r := 1; r <= s.n; r++ {
		mark := "  "
		if _, ok := s.holders[r]; ok {
			mark = "=>"
		}
		fmt.Fprintf(&b, "%s replica %d  %s\n", mark, r, s.states[r])
	}
	fmt.Fprintf(&b, "\nwaiters %d, acquisitions %d, hand-offs %d, overlaps %d, losses %d, errors %d\n\n",
		s.waiting, s.acquisitions, s.handoffs, s.overlaps, s.losses, s.errors)
	for _, e := range s.events {
		b.WriteString(e + "\n")
	}
	fmt.Fprint(s.out, b.String())
}

// demoContainer starts PostgreSQL from image with testcontainers and returns its DSN
// and a func that removes it. When Docker is not there it fails with one sentence.
func demoContainer(ctx context.Context, image string) (dsn string, stop func(), err error) {
	fail := func(err error) error {
		msg := strings.TrimSpace(strings.SplitN(fmt.Sprint(err), "\n", 2)[0])
		if len(msg) > 200 {
			msg = msg[:200] + "..."
		}
		return fmt.Errorf("demo needs a database: give one with -dsn or SQLLOCK_DSN, or run Docker so that it can start PostgreSQL in a container (%s)", msg)
	}
	defer func() { // testcontainers panics on some set-ups without Docker
		if p := recover(); p != nil {
			err = fail(fmt.Errorf("%v", p))
		}
	}()
	tclog.SetDefault(tclog.NewNoopLogger()) // its "Connected to docker" report is not for the user
	sctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	const user, password, database = "postgres", "sqllock", "demo"
	pgDSN := func(host, port string) string {
		u := url.URL{Scheme: "postgres", User: url.UserPassword(user, password), Host: net.JoinHostPort(host, port),
			Path: "/" + database, RawQuery: "sslmode=disable"}
		return u.String()
	}
	ctr, err := tcpostgres.Run(sctx, image,
		testcontainers.WithLogger(tclog.NewNoopLogger()),
		tcpostgres.WithUsername(user), tcpostgres.WithPassword(password), tcpostgres.WithDatabase(database),
		testcontainers.WithWaitStrategyAndDeadline(3*time.Minute,
			wait.ForLog("database system is ready to accept connections").WithOccurrence(2),
			wait.ForSQL("5432/tcp", "pgx", func(host string, port network.Port) string {
				return pgDSN(host, port.Port()) + "&connect_timeout=5"
			}),
		),
	)
	stop = func() {
		if ctr == nil {
			return
		}
		tctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		_ = ctr.Terminate(tctx)
	}
	if err != nil {
		stop()
		return "", nil, fail(err)
	}
	host, err := ctr.Host(sctx)
	if err != nil {
		stop()
		return "", nil, fail(err)
	}
	port, err := ctr.MappedPort(sctx, "5432/tcp")
	if err != nil {
		stop()
		return "", nil, fail(err)
	}
	return pgDSN(host, port.Port()), stop, nil
}
