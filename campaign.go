package sqllock

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/sqllock/sqllock/internal/backoff"
)

// DefaultRetryDelay is the pause of Campaign before it campaigns again after this
// replica stepped down or an acquisition failed (WithRetryDelay).
const DefaultRetryDelay = time.Second

// CampaignOption configures Campaign. Campaign validates its options before it sends
// any SQL and returns an error matching ErrInvalidOption for an invalid one.
type CampaignOption func(*campaignConfig) error

type campaignConfig struct {
	retry   time.Duration
	log     *slog.Logger
	acquire []AcquireOption
}

// WithRetryDelay sets the pause before Campaign campaigns again after fn returned nil
// (this replica stepped down) or after Acquire failed with an error other than the
// end of ctx (DefaultRetryDelay). Consecutive failures back off exponentially, with
// jitter, up to 16 times the delay. After a loss of the lease Campaign campaigns
// again at once: Acquire itself waits for the lock.
func WithRetryDelay(d time.Duration) CampaignOption {
	return func(c *campaignConfig) error {
		if d <= 0 {
			return fmt.Errorf("retry delay %v is not positive", d)
		}
		c.retry = d
		return nil
	}
}

// WithCampaignLogger sets the logger of Campaign's terms, losses and retried errors
// (default: none).
func WithCampaignLogger(l *slog.Logger) CampaignOption {
	return func(c *campaignConfig) error {
		if l == nil {
			return fmt.Errorf("nil logger")
		}
		c.log = l
		return nil
	}
}

// WithCampaignAcquireOptions passes opts to every Acquire of Campaign, for example
// WithLeaseTTL. They are validated with the other options.
func WithCampaignAcquireOptions(opts ...AcquireOption) CampaignOption {
	return func(c *campaignConfig) error {
		c.acquire = append(c.acquire, opts...)
		return nil
	}
}

// Campaign runs fn while this replica leads: it acquires the lock name with l
// (waiting as long as another replica holds it), runs fn with a context that is
// cancelled, with a cause matching ErrLost, as soon as the lease is lost, and
// campaigns again when fn returns, until ctx ends. It works with every strategy's
// Locker; in fn, LeaseFromContext returns the term's lease, whose Token fences the
// leader's writes.
//
// Guarantees, given by the lease core of the strategy (see the package
// documentation):
//
//   - At most one leader at any instant, in token order: a term runs only under a
//     held lease, so two terms never overlap as long as each leader stops working
//     when its context is cancelled, and every term's token is greater than every
//     earlier term's. A leader that is cut off, frozen or too slow has its context
//     cancelled before the database lets another replica take the lock (its local
//     deadline lies inside the server's bound); work it did after that instant is
//     not protected, which is what the token is for.
//   - Failover: when a leader dies or is partitioned from the database, a waiting
//     replica leads within the strategy's bound: the TTL, plus its poll interval and
//     one round trip (uniqueindex, optimistic, fairqueue); for advisory and forupdate
//     at once when the server sees the session end (a killed process), otherwise
//     within their TTL (the server's idle timeout on the session).
//
// When fn returns, Campaign releases the lease, then:
//
//   - if ctx has ended, it returns an error matching ctx.Err() (joined with fn's
//     error, if fn returned another one);
//   - if the lease was lost (fn's context was cancelled with ErrLost), it campaigns
//     again at once, whatever fn returned (fn's error is logged);
//   - if fn returned nil, this replica steps down: it campaigns again after the
//     retry delay, which gives other replicas the lock;
//   - if fn returned an error, Campaign returns it: a failing leader does not keep
//     the lock or campaign again. Return nil from fn (or retry inside it) to keep
//     campaigning after a failure.
//
// Acquire errors are retried after the retry delay with backoff (the database may be
// unreachable for a while), and logged, except those that cannot heal by waiting,
// which Campaign returns: ErrInvalidName, ErrInvalidOption and ErrNotMigrated.
//
// Campaign therefore never returns nil: it returns when ctx ends (an error matching
// ctx.Err(), also while it waits for the lock), when fn fails, or on a permanent
// error. On the way out it releases a held lease with a context detached from ctx,
// bounded by 30 seconds, so a replica that stops hands the lock on at once, not after
// its TTL. A Locker made by fairqueue.NewSemaphore with more than one permit is
// rejected (ErrInvalidOption): it would have several leaders.
func Campaign(ctx context.Context, l Locker, name string, fn func(ctx context.Context) error, opts ...CampaignOption) error {
	if err := ValidateName(name); err != nil {
		return err
	}
	cfg := campaignConfig{retry: DefaultRetryDelay, log: slog.New(slog.DiscardHandler)}
	invalid := func(err error) error {
		return &Error{Op: "campaign", Name: name, Kind: ErrInvalidOption, Err: err}
	}
	for _, o := range opts {
		if err := o(&cfg); err != nil {
			return invalid(err)
		}
	}
	switch {
	case l == nil:
		return invalid(errors.New("nil Locker"))
	case fn == nil:
		return invalid(errors.New("nil fn"))
	}
	if s, ok := l.(interface{ Permits() int }); ok && s.Permits() > 1 {
		return invalid(fmt.Errorf("a semaphore of %d permits has more than one holder", s.Permits()))
	}
	if _, err := ApplyAcquireOptions("campaign", 0, name, cfg.acquire); err != nil {
		return err
	}
	c := campaign{cfg: cfg, l: l, name: name, fn: fn, log: cfg.log.With("lock", name)}
	return c.run(ctx)
}

type campaign struct {
	cfg  campaignConfig
	l    Locker
	name string
	fn   func(ctx context.Context) error
	log  *slog.Logger
}

func (c *campaign) run(ctx context.Context) error {
	policy := backoff.Policy{Min: c.cfg.retry, Max: 16 * c.cfg.retry}
	failures := 0
	for {
		lease, err := c.l.Acquire(ctx, c.name, c.cfg.acquire...)
		if err != nil {
			if ctx.Err() != nil {
				return c.ended(ctx, nil)
			}
			if errors.Is(err, ErrInvalidName) || errors.Is(err, ErrInvalidOption) || errors.Is(err, ErrNotMigrated) {
				return err
			}
			c.log.Warn("sqllock: campaign: acquire failed, retrying", "err", err)
			if backoff.Sleep(ctx, policy.Delay(failures), nil) != nil {
				return c.ended(ctx, nil)
			}
			failures++
			continue
		}
		failures = 0
		again, err := c.term(ctx, lease)
		if !again {
			return err
		}
	}
}

// term runs fn under lease and releases it. It reports whether to campaign again, or
// the error Campaign returns.
func (c *campaign) term(ctx context.Context, lease Lease) (again bool, err error) {
	c.log.Info("sqllock: campaign: leading", "token", lease.Token())
	ferr, rerr, lost := runHeld(ctx, lease, c.fn)
	switch {
	case ctx.Err() != nil:
		if rerr != nil && !errors.Is(rerr, ErrLost) {
			c.log.Warn("sqllock: campaign: release failed", "token", lease.Token(), "err", rerr)
		}
		if ferr != nil && errors.Is(ferr, ctx.Err()) {
			ferr = nil
		}
		return false, c.ended(ctx, ferr)
	case lost || errors.Is(rerr, ErrLost):
		c.log.Warn("sqllock: campaign: leadership lost, campaigning again", "token", lease.Token(), "err", lease.Err(), "fn_err", ferr)
		return true, nil
	case ferr != nil:
		if rerr != nil {
			return false, errors.Join(ferr, rerr)
		}
		return false, ferr
	}
	if rerr != nil {
		c.log.Warn("sqllock: campaign: release failed", "token", lease.Token(), "err", rerr)
	}
	c.log.Info("sqllock: campaign: stepped down", "token", lease.Token())
	if backoff.Sleep(ctx, c.cfg.retry, nil) != nil {
		return false, c.ended(ctx, nil)
	}
	return true, nil
}

// ended is Campaign's error once ctx has ended, with fn's error if it had another.
func (c *campaign) ended(ctx context.Context, ferr error) error {
	err := &Error{Op: "campaign", Name: c.name, Err: ctx.Err()}
	if ferr != nil {
		return errors.Join(err, ferr)
	}
	return err
}
