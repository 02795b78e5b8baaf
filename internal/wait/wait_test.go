package wait

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/testdb"
)

func TestMain(m *testing.M) { os.Exit(testdb.MainLeakFree(m)) }

// parkedInEnqueue counts the goroutines blocked in Hub.Enqueue's select: the runtime's
// own account of which goroutines wait for the slot.
func parkedInEnqueue() int {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	n := 0
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, "[select") && strings.Contains(g, "wait.(*Hub).Enqueue") {
			n++
		}
	}
	return n
}

func waitParked(t *testing.T, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for parkedInEnqueue() != n {
		if time.Now().After(deadline) {
			t.Fatalf("%d goroutines parked in Enqueue, want %d", parkedInEnqueue(), n)
		}
		runtime.Gosched()
	}
}

// TestEnqueueFIFO: the waiters of one key in a Hub get the slot in the order in which
// they started to wait (the README's "waiters of one Locker queue first-in first-out
// in the process"); a waiter whose context ends leaves the queue without taking a
// turn, and another key has a queue of its own.
func TestEnqueueFIFO(t *testing.T) {
	h := NewHub(nil, sqllock.MySQL, "test", "", nil)
	defer h.Close()
	ctx := context.Background()
	first, err := h.Enqueue(ctx, "k")
	if err != nil {
		t.Fatal(err)
	}
	const waiters = 8
	order := make(chan int, waiters)
	slots := make(chan *Slot, waiters)
	cctx, cancel := context.WithCancel(ctx)
	gone := make(chan error, 1)
	for i := 1; i <= waiters; i++ {
		if i == 4 { // one waiter in the middle gives up
			go func() {
				_, err := h.Enqueue(cctx, "k")
				gone <- err
			}()
			waitParked(t, i)
			continue
		}
		go func() {
			s, err := h.Enqueue(ctx, "k")
			if err != nil {
				t.Error(err)
				return
			}
			order <- i
			slots <- s
		}()
		waitParked(t, i) // i waiters queued before the next starts
	}
	// Another key is not behind k's queue.
	other, err := h.Enqueue(testCtx(t), "other")
	if err != nil {
		t.Fatalf("Enqueue of another key: %v", err)
	}
	other.Leave()
	cancel()
	if err := <-gone; err == nil {
		t.Fatal("Enqueue with a cancelled context returned a slot")
	}
	first.Leave()
	for want := 1; want <= waiters; want++ {
		if want == 4 {
			continue
		}
		got := <-order
		if got != want {
			t.Fatalf("waiter %d got the slot, want %d", got, want)
		}
		s := <-slots
		s.Leave()
		s.Leave() // a second Leave must not hand on a turn it does not hold
	}
}

func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// TestLineTurnsCap: a Locker's line takes at most a quarter of a bounded pool's
// connections for its turns, none for a pool of fewer than 4 and at most 16 for a pool
// without a limit (the README's "at most 16 per Locker, a quarter of a bounded pool,
// none below 4 connections"), so waiters in line never exhaust the application's pool:
// with every turn out, the pool still serves a query. A turn given back can be taken
// again.
func TestLineTurnsCap(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		testdb.CheckLeaks(t)
		log := slog.New(slog.NewTextHandler(io.Discard, nil))
		for _, c := range []struct{ pool, turns int }{{0, 16}, {3, 0}, {4, 1}, {8, 2}, {40, 10}, {100, 16}} {
			t.Run(fmt.Sprintf("pool=%d", c.pool), func(t *testing.T) {
				ctx := testdb.Context(t, time.Minute)
				db := testdb.Open(t, d)
				db.SetMaxOpenConns(c.pool)
				ln := NewLine(db, d, "test", 30*time.Second, time.Second, log)
				defer ln.Close()
				var turns []*Turn
				defer func() {
					for _, tu := range turns {
						tu.Leave(ctx)
					}
				}()
				for i := 0; i < c.turns+3; i++ {
					tu := ln.Take(ctx, []byte(fmt.Sprintf("key-%d", i)))
					if tu == nil {
						break
					}
					turns = append(turns, tu)
				}
				if len(turns) != c.turns {
					t.Fatalf("pool of %d: %d turns out, want %d", c.pool, len(turns), c.turns)
				}
				var one int
				if err := db.QueryRowContext(ctx, "SELECT 1").Scan(&one); err != nil {
					t.Fatalf("the pool with every turn out: %v", err)
				}
				if c.turns == 0 {
					return
				}
				turns[0].Leave(ctx)
				again := ln.Take(ctx, []byte("again"))
				if again == nil {
					t.Fatal("no turn after one was given back")
				}
				turns[0] = again
				if extra := ln.Take(ctx, []byte("extra")); extra != nil {
					extra.Leave(ctx)
					t.Fatal("a turn beyond the cap after one was given back and taken again")
				}
			})
		}
	})
}
