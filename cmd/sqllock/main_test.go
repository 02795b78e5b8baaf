package main

import (
	"bytes"
	"context"
	"errors"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/testdb"
	"github.com/sqllock/sqllock/uniqueindex"
)

func TestMain(m *testing.M) { os.Exit(testdb.Main(m)) }

func runCLI(t *testing.T, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var out, errOut bytes.Buffer
	err := run(ctx, args, &out, &errOut)
	return out.String() + errOut.String(), err
}

// TestStatusAndForceRelease: status shows a held lease with its token; force-release
// revokes it: the holder learns of the loss at its next renewal, strictly before
// another client can acquire (which it can once the lease expires); force-release
// -now deletes the row at once.
func TestStatusAndForceRelease(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		dsn := testdb.DSN(t, d)
		if out, err := runCLI(t, "-dsn", dsn, "migrate", "version"); err != nil || !strings.Contains(out, "schema version") {
			t.Fatalf("migrate version: %v\n%s", err, out)
		}
		const ttl = 3 * time.Second
		l, err := uniqueindex.New(testdb.Open(t, d), d, uniqueindex.WithTTL(ttl))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { l.Close() })
		other, err := uniqueindex.New(testdb.Open(t, d), d, uniqueindex.WithTTL(ttl), uniqueindex.WithPollInterval(50*time.Millisecond))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { other.Close() })
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		name := testdb.Name(t, "nightly")
		lease, err := l.Acquire(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		out, err := runCLI(t, "-dsn", dsn, "status")
		if err != nil {
			t.Fatal(err)
		}
		var line string
		for _, ln := range strings.Split(out, "\n") {
			if f := strings.Fields(ln); len(f) > 1 && f[0] == "uniqueindex" && f[1] == name {
				line = ln
			}
		}
		if line == "" {
			t.Fatalf("status does not list %q:\n%s", name, out)
		}
		if f := strings.Fields(line); len(f) < 3 || f[2] != strconv.FormatInt(lease.Token(), 10) {
			t.Errorf("status line %q does not show token %d", line, lease.Token())
		}
		got := make(chan time.Time, 1)
		go func() {
			le, err := other.Acquire(ctx, name)
			if err != nil {
				t.Error(err)
				close(got)
				return
			}
			at := time.Now()
			if err := le.Release(ctx); err != nil {
				t.Error(err)
			}
			got <- at // after the release: the name is free again below
		}()
		if out, err := runCLI(t, "-dsn", dsn, "force-release", name); err != nil || !strings.Contains(out, "revoked") {
			t.Fatalf("force-release: %v\n%s", err, out)
		}
		revokedAt := time.Now()
		select {
		case <-lease.Done():
		case <-time.After(ttl):
			t.Fatal("the holder did not notice the revocation within its TTL (renewal every 1s)")
		}
		lostAt := time.Now()
		if !errors.Is(lease.Err(), sqllock.ErrLost) {
			t.Errorf("Err after force-release = %v, want ErrLost", lease.Err())
		}
		at, ok := <-got
		if ok && !at.After(lostAt) {
			t.Errorf("another client acquired %v after the revocation, before the holder was told (%v)", at.Sub(revokedAt), lostAt.Sub(revokedAt))
		}
		t.Logf("revoked: holder told after %v, next holder in after %v", lostAt.Sub(revokedAt).Round(time.Millisecond), at.Sub(revokedAt).Round(time.Millisecond))
		if err := lease.Release(ctx); !errors.Is(err, sqllock.ErrLost) {
			t.Errorf("Release after revocation = %v, want ErrLost", err)
		}
		if _, err := runCLI(t, "-dsn", dsn, "force-release", name); err == nil {
			t.Error("force-release of a free name succeeded")
		}

		// -now: the row goes at once.
		lease, err = l.Acquire(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		if out, err := runCLI(t, "-dsn", dsn, "force-release", "-now", name); err != nil || !strings.Contains(out, "released") {
			t.Fatalf("force-release -now: %v\n%s", err, out)
		}
		le, err := other.TryAcquire(ctx, name)
		if err != nil {
			t.Fatalf("TryAcquire right after force-release -now: %v", err)
		}
		le.Release(ctx)
		select {
		case <-lease.Done():
		case <-time.After(ttl):
			t.Fatal("the holder did not notice the deleted row within its TTL")
		}
		if !errors.Is(lease.Err(), sqllock.ErrLost) {
			t.Errorf("Err after force-release -now = %v, want ErrLost", lease.Err())
		}
	})
}

func TestUsage(t *testing.T) {
	for _, args := range [][]string{{}, {"status"}, {"-dsn", "postgres://x@127.0.0.1:1/x", "frobnicate"}} {
		if _, err := runCLI(t, args...); err == nil {
			t.Errorf("run(%q) succeeded", args)
		}
	}
	if driverFor("postgres://u@h/db") != "pgx" || driverFor("host=h user=u") != "pgx" || driverFor("u@tcp(h:3306)/db") != "mysql" {
		t.Error("driverFor")
	}
	if display("job") != "job" || display("a\x00b") != `"a\x00b"` || display("\xff") != `"\xff"` {
		t.Error("display")
	}
}
