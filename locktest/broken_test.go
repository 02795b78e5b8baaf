package locktest_test

import (
	"context"
	"database/sql"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/leasestate"
	"github.com/sqllock/sqllock/locktest"
	"github.com/sqllock/sqllock/testdb"
)

func TestMain(m *testing.M) { os.Exit(testdb.Main(m)) }

// grantAll is a deliberately broken Locker: it grants every request at once.
type grantAll struct{ tokens atomic.Int64 }

type grantAllLease struct {
	name  string
	token int64
	st    *leasestate.State
	once  sync.Once
}

func (g *grantAll) Acquire(ctx context.Context, name string, _ ...sqllock.AcquireOption) (sqllock.Lease, error) {
	if err := sqllock.ValidateName(name); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, &sqllock.Error{Op: "acquire", Kind: sqllock.ErrNotAcquired, Err: err}
	}
	return &grantAllLease{name: name, token: g.tokens.Add(1), st: leasestate.New()}, nil
}

func (g *grantAll) TryAcquire(ctx context.Context, name string, opts ...sqllock.AcquireOption) (sqllock.Lease, error) {
	return g.Acquire(ctx, name, opts...)
}

func (l *grantAllLease) Name() string          { return l.name }
func (l *grantAllLease) Token() int64          { return l.token }
func (l *grantAllLease) Done() <-chan struct{} { return l.st.Done() }
func (l *grantAllLease) Err() error            { return l.st.Err() }
func (l *grantAllLease) Release(context.Context) error {
	l.st.End(sqllock.ErrNotHeld)
	return nil
}

const childEnv = "SQLLOCK_LOCKTEST_BROKEN_CHILD"

// TestBrokenLockerChild runs the suite on the broken Locker. It does its work only
// when TestSuiteCatchesBrokenLocker starts it in a child process, where it must fail.
func TestBrokenLockerChild(t *testing.T) {
	d := sqllock.Dialect(0)
	switch os.Getenv(childEnv) {
	case "postgres":
		d = sqllock.Postgres
	case "mysql":
		d = sqllock.MySQL
	default:
		return // not in the child process: nothing to do
	}
	shared := &grantAll{}
	locktest.Run(t, locktest.Config{
		Dialect:     d,
		Sections:    400,
		LossTimeout: time.Second,
		New:         func(testing.TB, *sql.DB) sqllock.Locker { return shared },
		Lose:        func(testing.TB, *sql.DB, sqllock.Lease) {},
	})
}

// TestSuiteCatchesBrokenLocker proves the conformance suite can fail: run on a Locker
// that grants everyone, it must report the exclusion violation, the TryAcquire
// violation and the missing loss signal.
func TestSuiteCatchesBrokenLocker(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		cmd := exec.Command(os.Args[0], "-test.run=^TestBrokenLockerChild$", "-test.v", "-test.count=1")
		cmd.Env = append(os.Environ(),
			childEnv+"="+d.String(),
			testdb.EnvPostgresDSN+"="+testdb.DSN(t, sqllock.Postgres),
			testdb.EnvMySQLDSN+"="+testdb.DSN(t, sqllock.MySQL),
		)
		out, err := cmd.CombinedOutput()
		if err == nil {
			t.Fatalf("the suite passed a Locker that grants everyone:\n%s", out)
		}
		if _, ok := err.(*exec.ExitError); !ok {
			t.Fatalf("running the child: %v", err)
		}
		for _, want := range []string{
			"--- FAIL: TestBrokenLockerChild/Exclusion",
			"mutual exclusion violated",
			"--- FAIL: TestBrokenLockerChild/TryAcquire",
			"--- FAIL: TestBrokenLockerChild/Loss",
			"--- FAIL: TestBrokenLockerChild/Names",
			"--- PASS: TestBrokenLockerChild/ReleaseTwice",
		} {
			if !strings.Contains(string(out), want) {
				t.Errorf("child output lacks %q:\n%s", want, out)
			}
		}
	})
}
