package forupdate_test

import (
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/testdb"
)

// TestTokensAcrossCrash: a token drawn by a lease whose transaction never committed
// (the server is killed with SIGKILL while it is held, so neither the transaction
// nor the sequence's WAL or the AUTO_INCREMENT counter need have reached the disk)
// is smaller than every token drawn after the restart: tokens carry the epoch of
// the server's run (fence.EpochPostgres; on MySQL sqllock_run, a MEMORY table the
// restart empties, over the durable sqllock_epoch). Before, MySQL 9.7 handed out
// token 42 before the crash and 42 again after it.
func TestTokensAcrossCrash(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		if !testdb.Restartable(t, d) {
			return
		}
		tokensAcrossCrash(t, d)
	})
}

func tokensAcrossCrash(t *testing.T, d sqllock.Dialect) {
	ctx := testdb.Context(t, 5*time.Minute)
	l := newLocker(t, testdb.Open(t, d), d)
	name := testdb.Name(t)
	var last int64
	for i := range 40 { // past a logged batch of the sequence (32 values)
		le, err := l.Acquire(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		if le.Token() <= last {
			t.Fatalf("acquisition %d: token %d after %d", i, le.Token(), last)
		}
		last = le.Token()
		if err := le.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
	held, err := l.Acquire(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	before := held.Token()
	testdb.Crash(t, d)
	<-held.Done() // the session died with the server
	l2 := newLocker(t, testdb.Open(t, d), d)
	le, err := l2.Acquire(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	defer le.Release(ctx)
	if le.Token() <= before {
		t.Fatalf("token %d after the crash, %d drawn (uncommitted) before it", le.Token(), before)
	}
	t.Logf("token before the crash %d, after %d", before, le.Token())
}

// TestTokensAfterNodeSwitchMySQL: a name whose last token carries a newer epoch than
// the run this client talks to (what clients that fail over from one Galera node to
// another meet: each node keeps its own run epoch) gets a larger token still: the
// run records a newer epoch first.
func TestTokensAfterNodeSwitchMySQL(t *testing.T) {
	const d = sqllock.MySQL
	ctx := testdb.Context(t, time.Minute)
	admin := testdb.Open(t, d)
	l := newLocker(t, testdb.Open(t, d), d)
	name := testdb.Name(t)
	le, err := l.Acquire(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if err := le.Release(ctx); err != nil {
		t.Fatal(err)
	}
	// Another node's newer epoch: a row of sqllock_epoch above every other, and the
	// name's last token drawn under it.
	var top int64
	if err := admin.QueryRowContext(ctx, "SELECT COALESCE(MAX(epoch), 0) + 10 FROM sqllock_epoch").Scan(&top); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.ExecContext(ctx, "INSERT INTO sqllock_epoch (epoch, created_at) VALUES (?, UTC_TIMESTAMP(6))", top); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.ExecContext(ctx, "UPDATE sqllock_rowlock SET epoch = ? WHERE name = ?", top, []byte(name)); err != nil {
		t.Fatal(err)
	}
	before, err := l.CommittedToken(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	le, err = l.Acquire(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	defer le.Release(ctx)
	if le.Token() <= before {
		t.Fatalf("token %d after a newer epoch's token %d", le.Token(), before)
	}
	t.Logf("newer epoch's token %d, then %d", before, le.Token())
}
