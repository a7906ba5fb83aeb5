package cniplugin_test

import (
	"fmt"

	"github.com/leasehold/leasehold/cniplugin"
)

// Two default routes per family: the first listed is preferred on IPv4 and IPv6 alike,
// the second is a separate fallback route (not last-wins on IPv4, not ECMP on IPv6).
func ExampleResolveRoutes() {
	conf := []byte(`{
	  "cniVersion": "1.1.0", "name": "net1", "type": "macvlan", "master": "eth0",
	  "ipam": {
	    "type": "leasehold",
	    "ranges": [[{"subnet": "10.0.0.0/24"}], [{"subnet": "2001:db8::/64"}]],
	    "exclude": ["10.0.0.2", "10.0.0.9", "2001:db8::2"],
	    "routes": [
	      {"dst": "0.0.0.0/0", "gw": "10.0.0.1"}, {"dst": "0.0.0.0/0", "gw": "10.0.0.2"},
	      {"dst": "::/0", "gw": "2001:db8::1"}, {"dst": "::/0", "gw": "2001:db8::2"},
	      {"dst": "10.9.0.0/16", "gw": "10.0.0.9"}
	    ]
	  }
	}`)
	cfg, err := cniplugin.ParseConfig(conf, "K8S_POD_UID=uid-1", "c0ffee", "eth0", "/var/run/netns/x")
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, r := range cfg.Routes {
		fmt.Println(r.Dst, "via", r.GW, "priority", r.Priority)
	}
	fmt.Println("owner", cfg.Request.OwnerID(), "pool", cfg.Request.Pool.Name)
	// Output:
	// 0.0.0.0/0 via 10.0.0.1 priority 1024
	// 0.0.0.0/0 via 10.0.0.2 priority 1025
	// ::/0 via 2001:db8::1 priority 1024
	// ::/0 via 2001:db8::2 priority 1025
	// 10.9.0.0/16 via 10.0.0.9 priority 0
	// owner uid-1 pool net1
}
