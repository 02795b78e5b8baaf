package sqllock_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/leasestate"
	"github.com/sqllock/sqllock/testdb"
)

// memLocker is an in-process Locker used to test Do's own logic (not a database).
type memLocker struct {
	held  atomic.Bool
	token atomic.Int64
	last  *memLease
}

type memLease struct {
	l    *memLocker
	name string
	tok  int64
	st   *leasestate.State
}

func (m *memLocker) Acquire(ctx context.Context, name string, opts ...sqllock.AcquireOption) (sqllock.Lease, error) {
	if err := sqllock.ValidateName(name); err != nil {
		return nil, err
	}
	if _, err := sqllock.ApplyAcquireOptions("acquire", 0, name, opts); err != nil {
		return nil, err
	}
	if !m.held.CompareAndSwap(false, true) {
		return nil, &sqllock.Error{Op: "acquire", Name: name, Kind: sqllock.ErrNotAcquired}
	}
	m.last = &memLease{l: m, name: name, tok: m.token.Add(1), st: leasestate.New()}
	return m.last, nil
}

func (m *memLocker) TryAcquire(ctx context.Context, name string, opts ...sqllock.AcquireOption) (sqllock.Lease, error) {
	return m.Acquire(ctx, name, opts...)
}

func (l *memLease) Name() string          { return l.name }
func (l *memLease) Token() int64          { return l.tok }
func (l *memLease) Done() <-chan struct{} { return l.st.Done() }
func (l *memLease) Err() error            { return l.st.Err() }
func (l *memLease) lose() {
	l.st.End(&sqllock.Error{Op: "keepalive", Name: l.name, Kind: sqllock.ErrLost})
	l.l.held.Store(false)
}
func (l *memLease) Release(context.Context) error {
	if l.st.End(&sqllock.Error{Op: "release", Name: l.name, Kind: sqllock.ErrNotHeld}) {
		l.l.held.Store(false)
		return nil
	}
	if errors.Is(l.st.Err(), sqllock.ErrLost) {
		return l.st.Err()
	}
	return nil
}

func TestDoReleases(t *testing.T) {
	testdb.CheckLeaks(t)
	m := &memLocker{}
	ran := false
	if err := sqllock.Do(context.Background(), m, "job", func(ctx context.Context) error {
		ran = true
		if !m.held.Load() {
			t.Error("fn ran without the lock")
		}
		return nil
	}); err != nil || !ran {
		t.Fatalf("Do = %v, ran = %v", err, ran)
	}
	if m.held.Load() {
		t.Fatal("Do did not release")
	}
}

func TestDoReturnsFnError(t *testing.T) {
	testdb.CheckLeaks(t)
	m := &memLocker{}
	boom := errors.New("boom")
	if err := sqllock.Do(context.Background(), m, "job", func(context.Context) error { return boom }); !errors.Is(err, boom) {
		t.Fatalf("Do = %v, want fn's error", err)
	}
	if m.held.Load() {
		t.Fatal("Do did not release after fn failed")
	}
}

// TestDoCancelsOnLoss: when the lease is lost, fn's context is cancelled with a cause
// matching ErrLost, and Do reports ErrLost even though fn returned nil.
func TestDoCancelsOnLoss(t *testing.T) {
	testdb.CheckLeaks(t)
	m := &memLocker{}
	err := sqllock.Do(context.Background(), m, "job", func(ctx context.Context) error {
		m.last.lose()
		<-ctx.Done()
		if cause := context.Cause(ctx); !errors.Is(cause, sqllock.ErrLost) {
			t.Errorf("context cause = %v, want ErrLost", cause)
		}
		return nil
	})
	if !errors.Is(err, sqllock.ErrLost) {
		t.Fatalf("Do after loss = %v, want ErrLost", err)
	}
}

func TestDoNotAcquired(t *testing.T) {
	m := &memLocker{}
	m.held.Store(true)
	called := false
	err := sqllock.Do(context.Background(), m, "job", func(context.Context) error { called = true; return nil })
	if !errors.Is(err, sqllock.ErrNotAcquired) || called {
		t.Fatalf("Do on a held lock = %v (fn called %v), want ErrNotAcquired", err, called)
	}
}

func TestErrorMatchesKindAndCause(t *testing.T) {
	err := error(&sqllock.Error{Op: "acquire", Dialect: sqllock.MySQL, Name: "job", Kind: sqllock.ErrNotAcquired, Err: context.DeadlineExceeded})
	if !errors.Is(err, sqllock.ErrNotAcquired) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("%v does not match its kind and cause", err)
	}
	if errors.Is(err, sqllock.ErrLost) {
		t.Fatal("matches an unrelated sentinel")
	}
	var e *sqllock.Error
	if !errors.As(err, &e) || e.Op != "acquire" {
		t.Fatal("errors.As failed")
	}
	want := `sqllock: acquire (mysql) "job": lock not acquired: context deadline exceeded`
	if err.Error() != want {
		t.Fatalf("Error() = %q, want %q", err.Error(), want)
	}
	long := (&sqllock.Error{Op: "acquire", Name: strings.Repeat("n", 5000)}).Error()
	if len(long) > 200 {
		t.Fatalf("message of a long name is %d bytes: names must be elided", len(long))
	}
}

func TestValidateName(t *testing.T) {
	for _, tc := range []struct {
		name string
		ok   bool
	}{
		{"", false},
		{"a", true},
		{"\x00", true},
		{"\xff", true},
		{strings.Repeat("x", sqllock.MaxNameLen), true},
		{strings.Repeat("x", sqllock.MaxNameLen+1), false},
	} {
		err := sqllock.ValidateName(tc.name)
		if (err == nil) != tc.ok || (err != nil && !errors.Is(err, sqllock.ErrInvalidName)) {
			t.Errorf("ValidateName(%d bytes) = %v, want ok=%v", len(tc.name), err, tc.ok)
		}
	}
}

func TestApplyAcquireOptions(t *testing.T) {
	_, err := sqllock.ApplyAcquireOptions("try-acquire", sqllock.MySQL, "job", []sqllock.AcquireOption{sqllock.WithOwner("")})
	var e *sqllock.Error
	if !errors.Is(err, sqllock.ErrInvalidOption) || !errors.As(err, &e) || e.Op != "try-acquire" || e.Dialect != sqllock.MySQL || e.Name != "job" {
		t.Errorf("WithOwner(\"\") = %#v, want ErrInvalidOption labelled with op, dialect and name", err)
	}
	if _, err := sqllock.ApplyAcquireOptions("acquire", sqllock.Postgres, "job", []sqllock.AcquireOption{sqllock.WithLeaseTTL(-time.Second)}); !errors.Is(err, sqllock.ErrInvalidOption) {
		t.Errorf("WithTTL(-1s) = %v, want ErrInvalidOption", err)
	}
	c, err := sqllock.ApplyAcquireOptions("acquire", sqllock.Postgres, "job", []sqllock.AcquireOption{sqllock.WithOwner("job-7"), sqllock.WithLeaseTTL(time.Minute)})
	if err != nil || c.Owner != "job-7" || c.TTL != time.Minute {
		t.Errorf("ApplyAcquireOptions = %+v, %v", c, err)
	}
}

func TestDetectDialect(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		got, err := sqllock.DetectDialect(context.Background(), testdb.Open(t, d))
		if err != nil || got != d {
			t.Fatalf("DetectDialect = %v, %v; want %v", got, err, d)
		}
	})
}

func TestDialectString(t *testing.T) {
	if sqllock.Postgres.String() != "postgres" || sqllock.MySQL.String() != "mysql" || sqllock.Dialect(9).Valid() {
		t.Fatal("Dialect String/Valid")
	}
}
