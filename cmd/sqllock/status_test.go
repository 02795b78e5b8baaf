package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/advisory"
	"github.com/sqllock/sqllock/fairqueue"
	"github.com/sqllock/sqllock/forupdate"
	"github.com/sqllock/sqllock/internal/wait"
	"github.com/sqllock/sqllock/optimistic"
	"github.com/sqllock/sqllock/testdb"
	"github.com/sqllock/sqllock/uniqueindex"
)

// TestStatusEveryStrategy holds one lock of each strategy (with a waiter for
// fairqueue, forupdate and advisory, whose waiters the server shows) and checks that
// status --json lists each with its strategy, name, holder identity and waiters.
func TestStatusEveryStrategy(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		dsn := testdb.DSN(t, d)
		ctx := testdb.Context(t, time.Minute)
		type strategy struct {
			name    string
			waiters bool // a waiter is started, and listed as a waiter
			// line: a waiter is started; it holds the lock's server-side line, which
			// the lock's note says (and no advisory lock shows it)
			line bool
			newL func() (closer, error)
		}
		// Long enough for the whole test, even with a status run slowed by a large
		// database: a MySQL forupdate lease whose transaction stays idle ends after
		// its TTL less the margin (README, Known limitations).
		ttl := 2 * time.Minute
		strategies := []strategy{
			{"uniqueindex", false, true, func() (closer, error) { return uniqueindex.New(testdb.Open(t, d), d, uniqueindex.WithTTL(ttl)) }},
			{"optimistic", false, true, func() (closer, error) { return optimistic.New(testdb.Open(t, d), d, optimistic.WithTTL(ttl)) }},
			{"fairqueue", true, false, func() (closer, error) { return fairqueue.New(testdb.Open(t, d), d, fairqueue.WithTTL(ttl)) }},
			{"forupdate", true, false, func() (closer, error) {
				return forupdate.New(testdb.Open(t, d), d, forupdate.WithTTL(ttl), forupdate.WithKeepalive(2*time.Second))
			}},
			{"advisory", true, false, func() (closer, error) { return advisory.New(testdb.Open(t, d), d, advisory.WithTTL(ttl)) }},
		}
		names := map[string]string{}
		wctx, stopWaiters := context.WithCancel(ctx)
		var wg sync.WaitGroup
		defer wg.Wait()
		defer stopWaiters()
		for _, s := range strategies {
			name := testdb.Name(t, s.name)
			names[s.name] = name
			holder, err := s.newL()
			if err != nil {
				t.Fatal(err)
			}
			defer holder.Close()
			lease, err := holder.Acquire(ctx, name)
			if err != nil {
				t.Fatalf("%s: %v", s.name, err)
			}
			defer lease.Release(context.Background())
			if !s.waiters && !s.line {
				continue
			}
			waiter, err := s.newL()
			if err != nil {
				t.Fatal(err)
			}
			defer waiter.Close()
			wg.Add(1)
			go func() {
				defer wg.Done()
				le, err := waiter.Acquire(wctx, name)
				if err == nil {
					t.Errorf("%s: the waiter got the lock while it was held", s.name)
					le.Release(context.Background())
				} else if !errors.Is(err, sqllock.ErrNotAcquired) {
					t.Errorf("%s: waiter: %v", s.name, err)
				}
			}()
		}
		// The waiters stop before the holders release (deferred above), however the
		// test ends.
		defer func() { stopWaiters(); wg.Wait() }()
		var (
			locks    []Lock
			problems []string
			out      string
		)
		for deadline := time.Now().Add(15 * time.Second); ; {
			var err error
			// -name: advisory locks record their names nowhere.
			out, err = runCLI(t, "-dsn", dsn, "status", "--json", "-name", names["advisory"])
			if err != nil {
				t.Fatalf("status --json: %v\n%s", err, out)
			}
			doc := out[:strings.IndexByte(out, '\n')+1] // stderr (notes) follows
			locks = nil
			if err := json.Unmarshal([]byte(doc), &locks); err != nil {
				t.Fatalf("status --json: %v\n%s", err, out)
			}
			problems = checkListed(locks, names, strategies[0].name, func(s string) bool {
				for _, st := range strategies {
					if st.name == s {
						return st.waiters
					}
				}
				return false
			})
			for _, l := range locks {
				if strings.HasPrefix(l.Key, wait.MyTicketPrefix) {
					// fairqueue's MySQL waiter holds the lock of its ticket: its waiter
					// is listed from the tickets, not as an advisory lock.
					problems = append(problems, fmt.Sprintf("a fairqueue ticket's lock listed as a lock of its own: %+v", l))
				}
			}
			for _, st := range strategies {
				if !st.line {
					continue
				}
				for _, l := range locks {
					if l.Strategy == st.name && l.Name != nil && *l.Name == names[st.name] && !strings.Contains(l.Note, "server-side line held by session") {
						problems = append(problems, fmt.Sprintf("%s lock %s: its waiter's server-side line not in the note (%q)", st.name, names[st.name], l.Note))
					}
				}
			}
			if len(problems) == 0 || time.Now().After(deadline) {
				break
			}
			time.Sleep(200 * time.Millisecond)
		}
		for _, p := range problems {
			t.Error(p)
		}
		if t.Failed() {
			t.Logf("status --json:\n%s", out)
		}
		for _, l := range locks {
			if l.Name != nil && strings.HasPrefix(*l.Name, t.Name()) {
				b, _ := json.Marshal(l)
				t.Logf("%s", b)
			}
		}
		// The table lists the same.
		table, err := runCLI(t, "-dsn", dsn, "status", "-name", names["advisory"])
		if err != nil {
			t.Fatal(err)
		}
		for s, n := range names {
			if !strings.Contains(table, n) {
				t.Errorf("the table does not list %s lock %s:\n%s", s, n, table)
			}
		}
	})
}

type closer interface {
	sqllock.Locker
	Close() error
}

// checkListed returns what is missing from locks: per strategy, the lock named
// names[strategy] with a holder identity, and a waiter where wantWaiter says so.
func checkListed(locks []Lock, names map[string]string, _ string, wantWaiter func(string) bool) (problems []string) {
	for s, n := range names {
		var found *Lock
		for i := range locks {
			if locks[i].Strategy == s && locks[i].Name != nil && *locks[i].Name == n {
				found = &locks[i]
			}
		}
		switch {
		case found == nil:
			problems = append(problems, fmt.Sprintf("%s lock %s not listed", s, n))
		case found.Holder == nil:
			problems = append(problems, fmt.Sprintf("%s lock %s: no holder", s, n))
		case !identified(*found.Holder):
			problems = append(problems, fmt.Sprintf("%s lock %s: holder without identity", s, n))
		case wantWaiter(s) && len(found.Waiters) == 0:
			problems = append(problems, fmt.Sprintf("%s lock %s: no waiter listed", s, n))
		case wantWaiter(s) && !identified(found.Waiters[0]):
			problems = append(problems, fmt.Sprintf("%s lock %s: waiter without identity", s, n))
		}
	}
	return problems
}

// identified: host and pid, or a server session.
func identified(p Party) bool {
	return p.Host != nil && *p.Host != "" && p.PID != nil && *p.PID > 0 || p.Session != nil && *p.Session > 0
}

// TestStatusWithoutLockViews: a user who may read the library's tables but not the
// server's lock views (performance_schema, INNODB_LOCK_WAITS without PROCESS) still
// gets every lease row; what it cannot see is a note, not a failure.
func TestStatusWithoutLockViews(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		ctx := testdb.Context(t, time.Minute)
		l, err := uniqueindex.New(testdb.Open(t, d), d)
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		name := testdb.Name(t, "status-low")
		le, err := l.Acquire(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		defer le.Release(ctx)
		var grants []string
		for _, tbl := range []string{"sqllock_fence", "sqllock_lease", "sqllock_optimistic", "sqllock_ticket", "sqllock_queue", "sqllock_rowlock"} {
			grants = append(grants, "SELECT ON "+tbl)
		}
		low := testdb.OpenAs(t, d, grants...)
		snap, err := collect(ctx, low, d, statusOpts{})
		if err != nil {
			t.Fatalf("status as a user without the lock views: %v", err)
		}
		found := false
		for _, lk := range snap.Locks {
			found = found || (lk.Name != nil && *lk.Name == name && lk.Strategy == "uniqueindex")
		}
		if !found {
			t.Errorf("the held lease %q is not listed: %+v", name, snap.Locks)
		}
		t.Logf("notes: %q", snap.Notes)
	})
}
