// Package reaper deletes what dead lock holders left behind: expired lease rows of the
// uniqueindex strategy, and whatever later strategies register as a Sweeper (the fair
// queue's dead waiters).
//
// A Reaper runs on a robfig/cron/v3 schedule, or by hand with RunOnce. Each Sweeper
// deletes in bounded batches, every batch in its own short statement, so the reaper
// never holds many row locks or a long transaction. It is safe to run on every node
// at once and does not stall live lock holders: on PostgreSQL a batch locks its rows
// FOR UPDATE SKIP LOCKED and never waits; on MySQL it picks its rows with a
// non-locking read and deletes them by primary key, locking only those rows and no
// index range. A row is deleted only if it is still expired by the database clock
// when its lock is taken. A deadlock or lock wait timeout that a batch still meets is
// counted in the Report and the batch is retried after a short jittered pause; after
// a few in a row the Sweeper's turn ends without an error and the next run goes on.
// The reaper is an optimisation of storage, not of availability: acquirers take
// expired rows over without it. Fencing tokens are kept in sqllock_fence, which is
// never swept, so they keep increasing across sweeps.
package reaper

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/robfig/cron/v3"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/fairqueue"
	"github.com/sqllock/sqllock/internal/backoff"
	"github.com/sqllock/sqllock/internal/lease"
	"github.com/sqllock/sqllock/internal/sqlerr"
	"github.com/sqllock/sqllock/optimistic"
	"github.com/sqllock/sqllock/uniqueindex"
)

// Defaults of the options.
const (
	// DefaultSchedule runs the reaper every minute.
	DefaultSchedule = "@every 1m"
	// DefaultBatchSize is the largest number of rows one batch deletes.
	DefaultBatchSize = 1000
	// DefaultGrace is how long past its expiry a row is kept (for operators).
	DefaultGrace = time.Minute
	// DefaultMaxBatches bounds the batches of one Sweeper in one run.
	DefaultMaxBatches = 1000
)

// Sweeper deletes one kind of dead rows. SweepBatch deletes at most limit of them in
// one short statement or transaction and returns how many it deleted and whether the
// batch was full (it found limit candidates, so more may be left, even if another
// reaper or a takeover got some of them first); the reaper calls it again while more
// is true. Implementations must be safe when many reapers call them at once, and
// should lock only the rows they delete. A transient error (deadlock, serialization
// failure, lock wait timeout) must leave nothing half done: the reaper retries the
// batch.
type Sweeper interface {
	Name() string
	SweepBatch(ctx context.Context, limit int) (deleted int, more bool, err error)
}

// Report is what one run removed.
type Report struct {
	Deleted   map[string]int // rows deleted, by Sweeper name
	Batches   int            // batches sent, retries included
	Conflicts int            // transient errors (deadlock, lock wait timeout) met and retried or given up on
	Duration  time.Duration
}

// maxConflicts is how many transient errors in a row end a Sweeper's turn in a run.
const maxConflicts = 5

// conflictPolicy spaces the retries of a batch after a transient error.
var conflictPolicy = backoff.Policy{Min: 5 * time.Millisecond, Max: 200 * time.Millisecond}

// Option configures a Reaper. Options are validated by New.
type Option func(*config) error

type config struct {
	schedule          string
	batch, maxBatches int
	grace             time.Duration
	sweepers          []Sweeper
	logger            *slog.Logger
}

// WithSchedule sets the cron schedule (DefaultSchedule), in the syntax of
// robfig/cron/v3's standard parser: five fields, or descriptors such as "@every 30s".
func WithSchedule(spec string) Option {
	return func(c *config) error {
		if _, err := cron.ParseStandard(spec); err != nil {
			return fmt.Errorf("schedule %q: %w", spec, err)
		}
		c.schedule = spec
		return nil
	}
}

// WithBatchSize sets the rows per batch (DefaultBatchSize).
func WithBatchSize(n int) Option {
	return func(c *config) error {
		if n <= 0 {
			return fmt.Errorf("batch size %d is not positive", n)
		}
		c.batch = n
		return nil
	}
}

// WithMaxBatches bounds the batches of one Sweeper per run (DefaultMaxBatches).
func WithMaxBatches(n int) Option {
	return func(c *config) error {
		if n <= 0 {
			return fmt.Errorf("max batches %d is not positive", n)
		}
		c.maxBatches = n
		return nil
	}
}

// WithGrace keeps expired rows for d past their expiry (DefaultGrace).
func WithGrace(d time.Duration) Option {
	return func(c *config) error {
		if d < 0 {
			return fmt.Errorf("grace %v is negative", d)
		}
		c.grace = d
		return nil
	}
}

// WithSweepers adds sweepers, run after the lease table's.
func WithSweepers(s ...Sweeper) Option {
	return func(c *config) error {
		for _, sw := range s {
			if sw == nil {
				return errors.New("nil Sweeper")
			}
		}
		c.sweepers = append(c.sweepers, s...)
		return nil
	}
}

// WithLogger sets the logger of the counts (default: none).
func WithLogger(l *slog.Logger) Option {
	return func(c *config) error {
		if l == nil {
			return errors.New("nil logger")
		}
		c.logger = l
		return nil
	}
}

// Reaper deletes expired rows on a schedule. Its methods are safe for concurrent use.
type Reaper struct {
	cfg      config
	sweepers []Sweeper
	dialect  sqllock.Dialect

	mu      sync.Mutex
	cron    *cron.Cron
	cancel  context.CancelFunc
	runCtx  context.Context
	running sync.Mutex // one run at a time in this process
}

// New returns a Reaper of the lease table of db (see uniqueindex.NewSweeper), of the
// optimistic strategy's rows of unused names (optimistic.NewSweeper) and of the fair
// queue's dead tickets (fairqueue.NewSweeper), plus the sweepers given with
// WithSweepers. It returns an error matching
// sqllock.ErrInvalidOption for a bad option.
func New(db *sql.DB, d sqllock.Dialect, opts ...Option) (*Reaper, error) {
	cfg := config{schedule: DefaultSchedule, batch: DefaultBatchSize, maxBatches: DefaultMaxBatches, grace: DefaultGrace}
	if err := lease.Apply(&cfg, opts); err != nil {
		return nil, lease.NewError("reaper", d, "", sqllock.ErrInvalidOption, err)
	}
	if db == nil || !d.Valid() {
		return nil, lease.NewError("reaper", d, "", sqllock.ErrInvalidOption, errors.New("need a *sql.DB and a valid dialect"))
	}
	if cfg.logger == nil {
		cfg.logger = slog.New(slog.DiscardHandler)
	}
	lease, err := uniqueindex.NewSweeper(db, d, cfg.grace)
	if err != nil {
		return nil, err
	}
	versions, err := optimistic.NewSweeper(db, d, cfg.grace)
	if err != nil {
		return nil, err
	}
	tickets, err := fairqueue.NewSweeper(db, d, cfg.grace)
	if err != nil {
		return nil, err
	}
	return &Reaper{cfg: cfg, dialect: d, sweepers: append([]Sweeper{lease, versions, tickets}, cfg.sweepers...)}, nil
}

// Start runs the reaper on its schedule in the background until Stop. A run that is
// still going when the next is due makes that one skip. Calling Start twice does
// nothing.
func (r *Reaper) Start() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.cron != nil {
		return
	}
	r.runCtx, r.cancel = context.WithCancel(context.Background())
	ctx := r.runCtx
	c := cron.New(cron.WithChain(cron.SkipIfStillRunning(cron.DiscardLogger)))
	c.AddFunc(r.cfg.schedule, func() {
		if _, err := r.RunOnce(ctx); err != nil && ctx.Err() == nil {
			r.cfg.logger.Warn("sqllock/reaper: run failed", "err", err)
		}
	})
	c.Start()
	r.cron = c
}

// Stop stops the schedule, cancels a run in progress and waits for it to end, or for
// ctx. It is safe to call without Start and more than once.
func (r *Reaper) Stop(ctx context.Context) error {
	r.mu.Lock()
	c, cancel := r.cron, r.cancel
	r.cron, r.cancel = nil, nil
	r.mu.Unlock()
	if c == nil {
		return nil
	}
	cancel()
	select {
	case <-c.Stop().Done():
		return nil
	case <-ctx.Done():
		return &sqllock.Error{Op: "reaper-stop", Dialect: r.dialect, Err: ctx.Err()}
	}
}

// RunOnce runs every Sweeper now, batch after batch, until a batch is not full, the
// maximum number of batches is reached or ctx ends. A deadlock, serialization failure
// or lock wait timeout is counted in Report.Conflicts and the batch is retried after a
// short jittered pause; after 5 in a row that Sweeper's turn ends without an error
// (the next run goes on). Other errors are returned, after the other sweepers ran. It
// logs and returns the counts.
func (r *Reaper) RunOnce(ctx context.Context) (Report, error) {
	r.running.Lock()
	defer r.running.Unlock()
	start := time.Now()
	rep := Report{Deleted: map[string]int{}}
	var errs []error
	for _, s := range r.sweepers {
		conflicts := 0
		for b := 0; b < r.cfg.maxBatches; b++ {
			if err := ctx.Err(); err != nil {
				errs = append(errs, err)
				break
			}
			n, more, err := s.SweepBatch(ctx, r.cfg.batch)
			rep.Batches++
			rep.Deleted[s.Name()] += n
			if err != nil && sqlerr.Transient(err) && ctx.Err() == nil {
				rep.Conflicts++
				if conflicts++; conflicts >= maxConflicts {
					r.cfg.logger.Warn("sqllock/reaper: giving up until the next run after repeated conflicts",
						"sweeper", s.Name(), "conflicts", conflicts, "err", err)
					break
				}
				r.cfg.logger.Debug("sqllock/reaper: batch conflicted, retrying", "sweeper", s.Name(), "err", err)
				if backoff.Sleep(ctx, conflictPolicy.Delay(conflicts-1), nil) != nil {
					errs = append(errs, ctx.Err())
					break
				}
				continue
			}
			if err != nil {
				errs = append(errs, fmt.Errorf("%s: %w", s.Name(), err))
				break
			}
			conflicts = 0
			if !more {
				break
			}
		}
	}
	rep.Duration = time.Since(start)
	args := []any{"batches", rep.Batches, "conflicts", rep.Conflicts, "duration", rep.Duration}
	for name, n := range rep.Deleted {
		args = append(args, name, n)
	}
	r.cfg.logger.Info("sqllock/reaper: swept", args...)
	if len(errs) > 0 {
		// A sweeper whose table, column or index is missing matches ErrNotMigrated.
		return rep, lease.NewError("reaper", r.dialect, "", nil, errors.Join(errs...))
	}
	return rep, nil
}

var (
	_ Sweeper = (*uniqueindex.Sweeper)(nil)
	_ Sweeper = (*optimistic.Sweeper)(nil)
	_ Sweeper = (*fairqueue.Sweeper)(nil)
)
