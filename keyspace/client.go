package keyspace

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"go.etcd.io/etcd/client/pkg/v3/transport"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// ClientConfig is how leaseholdd and leaseholdctl reach etcd; the fields mirror etcdctl's
// connection flags.
type ClientConfig struct {
	Endpoints []string
	// CACert, Cert and Key are PEM files for TLS; Cert and Key go together.
	CACert, Cert, Key string
	// Username and Password enable etcd authentication when Username is set.
	Username, Password string
	// DialTimeout bounds the first connection; default DefaultDialTimeout.
	DialTimeout time.Duration
}

// DefaultDialTimeout bounds the first connection when ClientConfig.DialTimeout is zero.
const DefaultDialTimeout = 5 * time.Second

// Keep-alive pings on the client's connection find a dead one long before a lease TTL runs
// out: a ping every keepAlivePing, and the connection given up without an answer within
// keepAliveWait.
const (
	keepAlivePing = 10 * time.Second
	keepAliveWait = 5 * time.Second
)

// ErrClientConfig is wrapped by every error Dial returns for unusable settings.
var ErrClientConfig = errors.New("etcd connection settings are not usable")

// Dial returns a client for cfg. It fails early, naming the file, when a TLS file is missing
// or the certificate does not match its key; it does not wait for etcd to answer.
func (cfg ClientConfig) Dial() (*clientv3.Client, error) {
	if len(cfg.Endpoints) == 0 {
		return nil, fmt.Errorf("%w: no etcd endpoints given (--etcd-endpoints / --endpoints)", ErrClientConfig)
	}
	var tlsCfg *tls.Config
	if cfg.CACert != "" || cfg.Cert != "" || cfg.Key != "" {
		if (cfg.Cert == "") != (cfg.Key == "") {
			return nil, fmt.Errorf("%w: a client certificate needs both cert and key (got cert %q, key %q)", ErrClientConfig, cfg.Cert, cfg.Key)
		}
		for _, f := range []string{cfg.CACert, cfg.Cert, cfg.Key} {
			if f == "" {
				continue
			}
			if _, err := os.Stat(f); err != nil {
				return nil, fmt.Errorf("%w: TLS file: %w", ErrClientConfig, err)
			}
		}
		info := transport.TLSInfo{CertFile: cfg.Cert, KeyFile: cfg.Key, TrustedCAFile: cfg.CACert}
		var err error
		if tlsCfg, err = info.ClientConfig(); err != nil {
			return nil, fmt.Errorf("%w: TLS files (ca %q, cert %q, key %q): %w", ErrClientConfig, cfg.CACert, cfg.Cert, cfg.Key, err)
		}
	}
	for _, e := range cfg.Endpoints {
		if strings.HasPrefix(e, "http://") && tlsCfg != nil {
			return nil, fmt.Errorf("%w: endpoint %s is plain http but TLS files were given; use https://", ErrClientConfig, e)
		}
	}
	timeout := cfg.DialTimeout
	if timeout <= 0 {
		timeout = DefaultDialTimeout
	}
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:            cfg.Endpoints,
		TLS:                  tlsCfg,
		Username:             cfg.Username,
		Password:             cfg.Password,
		DialTimeout:          timeout,
		Logger:               zap.NewNop(),
		DialKeepAliveTime:    keepAlivePing,
		DialKeepAliveTimeout: keepAliveWait,
	})
	if err != nil {
		return nil, fmt.Errorf("connect to etcd at %s: %w", strings.Join(cfg.Endpoints, ","), err)
	}
	return cli, nil
}

// CheckConnection asks etcd for one small read within timeout and turns a failure into an
// error an operator can act on. Agents call it at start, so a wrong endpoint, a rejected
// certificate or missing credentials stop the start with a reason, not a hang.
func CheckConnection(ctx context.Context, cli *clientv3.Client, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	_, err := cli.Get(ctx, PoolsPrefix(), clientv3.WithCountOnly(), clientv3.WithPrefix())
	if err == nil {
		return nil
	}
	return fmt.Errorf("etcd at %s did not answer a read within %s: %w; check the endpoints, that etcd runs, the TLS "+
		"files (a server requiring client certificates refuses a client without one) and the user's permissions",
		strings.Join(cli.Endpoints(), ","), timeout, err)
}
