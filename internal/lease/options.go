package lease

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/deploy"
)

// Config holds the options every strategy shares. A strategy's config embeds it and
// its With* options call these setters, so that every strategy validates the same
// option the same way, at construction.
type Config struct {
	Timing Timing
	Logger *slog.Logger
	// TelemetryNames records lock names in spans (default: a hash of the name).
	TelemetryNames bool
	// RequireSync refuses a PostgreSQL primary with asynchronous standbys (see
	// internal/deploy) instead of logging a warning.
	RequireSync bool
	// GaleraSingleWriter accepts a Galera node for the server-local strategies on the
	// user's promise that every client reaches the same writer node.
	GaleraSingleWriter bool
}

// Guard returns the deployment check of a Locker of strategy on db under these
// options; needs tells what the strategy needs of the server (OneNode, MemoryTable),
// the options add the user's promises and demands.
func (c *Config) Guard(db *sql.DB, d sqllock.Dialect, strategy string, needs deploy.Needs) *deploy.Guard {
	needs.SingleWriter, needs.RequireSync = c.GaleraSingleWriter, c.RequireSync
	return deploy.New(db, d, strategy, needs, c.Logger)
}

// SetRequireSyncReplication refuses asynchronous standbys.
func (c *Config) SetRequireSyncReplication() error {
	c.RequireSync = true
	return nil
}

// SetGaleraSingleWriter accepts a Galera node (server-local strategies).
func (c *Config) SetGaleraSingleWriter() error {
	c.GaleraSingleWriter = true
	return nil
}

// Label returns the label of a lease of name by strategy on dialect d, under these
// options.
func (c *Config) Label(strategy string, d sqllock.Dialect, name string) Label {
	return Label{Strategy: strategy, Dialect: d, Name: name, ExposeName: c.TelemetryNames}
}

// SetTTL sets the server-enforced bound of a lease.
func (c *Config) SetTTL(d time.Duration) error {
	if d < MinTTL {
		return fmt.Errorf("TTL %v is shorter than %v", d, MinTTL)
	}
	c.Timing.TTL = d
	return nil
}

// SetInterval sets the keep-alive interval.
func (c *Config) SetInterval(d time.Duration) error {
	if d <= 0 {
		return fmt.Errorf("keep-alive interval %v is not positive", d)
	}
	c.Timing.Interval = d
	return nil
}

// SetLogger sets the logger.
func (c *Config) SetLogger(l *slog.Logger) error {
	if l == nil {
		return errors.New("nil logger")
	}
	c.Logger = l
	return nil
}

// SetTelemetryNames records lock names in spans.
func (c *Config) SetTelemetryNames() error {
	c.TelemetryNames = true
	return nil
}

// Apply applies opts to c in order and returns the first error.
func Apply[C any, O ~func(*C) error](c *C, opts []O) error {
	for _, o := range opts {
		if o == nil {
			continue
		}
		if err := o(c); err != nil {
			return err
		}
	}
	return nil
}

// New applies opts to cfg (whose embedded Config holds the strategy's defaults),
// resolves the timing and checks db and d, for a strategy's constructor. Errors match
// sqllock.ErrInvalidOption and are labelled with op "new", the strategy and dialect.
func New[C any, O ~func(*C) error](strategy string, db *sql.DB, d sqllock.Dialect, cfg *C, common *Config, opts []O) error {
	lb := Label{Strategy: strategy, Dialect: d}
	bad := func(err error) error {
		return lb.Err("new", sqllock.ErrInvalidOption, fmt.Errorf("%s: %w", strategy, err))
	}
	switch {
	case db == nil:
		return bad(errors.New("nil *sql.DB"))
	case !d.Valid():
		return bad(fmt.Errorf("unknown dialect %v", d))
	}
	if err := Apply(cfg, opts); err != nil {
		return bad(err)
	}
	t, err := common.Timing.Resolve()
	if err != nil {
		return bad(err)
	}
	common.Timing = t
	if common.Logger == nil {
		common.Logger = slog.New(slog.DiscardHandler)
	}
	return nil
}

// Admit is the check every acquisition makes before its own SQL: ctx has not ended
// (else an error matching sqllock.ErrNotAcquired), and the deployment suits the
// strategy (g.Check, which sends SQL only until it has an answer). A refusal matches
// sqllock.ErrUnsafeDeployment; a probe that ctx cut short matches
// sqllock.ErrNotAcquired too. Errors are labelled with op, d and name.
func Admit(ctx context.Context, g *deploy.Guard, op string, d sqllock.Dialect, name string) error {
	if err := ctx.Err(); err != nil {
		return NewError(op, d, name, sqllock.ErrNotAcquired, err)
	}
	if err := g.Check(ctx); err != nil {
		var kind error
		if !errors.Is(err, sqllock.ErrUnsafeDeployment) && ctx.Err() != nil {
			kind = sqllock.ErrNotAcquired
		}
		return NewError(op, d, name, kind, err)
	}
	return nil
}
