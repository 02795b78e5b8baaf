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
// deletes it, and the holder learns of the loss from its watchdog.
func TestStatusAndForceRelease(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		dsn := testdb.DSN(t, d)
		if out, err := runCLI(t, "-dsn", dsn, "migrate", "version"); err != nil || !strings.Contains(out, "schema version") {
			t.Fatalf("migrate version: %v\n%s", err, out)
		}
		l, err := uniqueindex.New(testdb.Open(t, d), d, uniqueindex.WithTTL(3*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { l.Close() })
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
			if strings.HasPrefix(ln, name) {
				line = ln
			}
		}
		if line == "" {
			t.Fatalf("status does not list %q:\n%s", name, out)
		}
		if f := strings.Fields(line); len(f) < 5 || f[4] != strconv.FormatInt(lease.Token(), 10) {
			t.Errorf("status line %q does not show token %d", line, lease.Token())
		}
		if out, err := runCLI(t, "-dsn", dsn, "force-release", name); err != nil || !strings.Contains(out, "released") {
			t.Fatalf("force-release: %v\n%s", err, out)
		}
		select {
		case <-lease.Done():
		case <-time.After(5 * time.Second):
			t.Fatal("the holder did not notice the forced release within 5s (renewal every 1s)")
		}
		if !errors.Is(lease.Err(), sqllock.ErrLost) {
			t.Errorf("Err after force-release = %v, want ErrLost", lease.Err())
		}
		if _, err := runCLI(t, "-dsn", dsn, "force-release", name); err == nil {
			t.Error("force-release of a free name succeeded")
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
