package leases

import (
	"go/ast"
	"go/token"
	"sort"
	"strings"
	"testing"
)

// TestOwnerLockOrder checks the lock order ownerlock/ownerlock.go states, on the agent's code:
// a method of Agent (or of a part of it, lockParts) that holds an owner lock (it is handed
// an ownerlock.Owned, or takes one) never calls, directly or through other methods, a method
// that takes an owner lock (a second owner's, or its own again: a deadlock) or
// the import's importMu (taken before an owner lock, never after). Calls in a goroutine the
// method starts do not hold its lock and are not followed. A call of a part's func field is
// followed into what the agent wires into it (a method value a.release.ReleaseOwner, or the
// calls of a func literal), wherever a composite literal of the part's type sets the field,
// or of its package's Config for a part cut out as a package (partPkgs), whose methods call
// them as recv.cfg.Field, in Start or a method of Agent.
func TestOwnerLockOrder(t *testing.T) {
	// lockParts are the fields of Agent whose type's methods are followed too, by type: a
	// call a.sticky.KeepClaimLocked is one of Claims.KeepClaimLocked. A part's call of
	// a func field Start wired to the Agent's method of the same name (im.heldFor) is one of
	// that method; a call of a part's func field that the agent sets by name is followed into
	// what it sets there (r.Wake is what newReleaser wires into Releaser.Wake).
	lockParts := map[string]string{"sticky": "Claims", "recovery": "Reclaimer", "notices": "Notices",
		"cwatch": "Watch", "imports": "Importer", "audit": "Auditor", "release": "Releaser",
		"attach": "Attachments"}
	// partPkgs are the parts cut out as packages under leases/: their directory and package
	// name, and their type.
	partPkgs := map[string]string{"audit": "Auditor", "restorenotice": "Notices", "release": "Releaser",
		"reclaim": "Reclaimer", "imports": "Importer", "attach": "Attachments", "sticky": "Claims",
		"conflicts": "Watch"}
	dirs := []string{"."}
	for dir := range partPkgs {
		dirs = append(dirs, dir)
	}
	types := map[string]bool{"Agent": true}
	for _, typ := range lockParts {
		types[typ] = true
	}
	type method struct {
		pos                   token.Position
		holds, owner, importM bool
		calls                 map[string]bool
	}
	methods := map[string]*method{}
	fset := token.NewFileSet()
	for _, src := range agentSource(t, fset, dirs...) {
		for _, d := range src.f.Decls {
			fn, ok := d.(*ast.FuncDecl)
			if !ok || fn.Body == nil || fn.Recv == nil || len(fn.Recv.List) != 1 || len(fn.Recv.List[0].Names) != 1 {
				continue
			}
			star, ok := fn.Recv.List[0].Type.(*ast.StarExpr)
			if !ok || !types[star.X.(*ast.Ident).Name] {
				continue
			}
			typ := star.X.(*ast.Ident).Name
			recv := fn.Recv.List[0].Names[0].Name
			m := &method{pos: fset.Position(fn.Pos()), calls: map[string]bool{}}
			for _, p := range fn.Type.Params.List {
				if star, ok := p.Type.(*ast.StarExpr); ok {
					if sel, ok := star.X.(*ast.SelectorExpr); ok && sel.Sel.Name == "Owned" {
						if pkg, ok := sel.X.(*ast.Ident); ok && pkg.Name == "ownerlock" {
							m.holds = true
						}
					}
				}
			}
			ast.Inspect(fn.Body, func(n ast.Node) bool {
				if _, ok := n.(*ast.GoStmt); ok {
					return false // another goroutine: it holds nothing of this one's
				}
				call, ok := n.(*ast.CallExpr)
				if !ok {
					return true
				}
				sel, ok := call.Fun.(*ast.SelectorExpr)
				if !ok {
					return true
				}
				switch inner, _ := sel.X.(*ast.SelectorExpr); {
				case inner != nil && strings.EqualFold(inner.Sel.Name, "locks") && sel.Sel.Name == "Lock":
					m.owner, m.holds = true, true
				case inner != nil && inner.Sel.Name == "importMu" && sel.Sel.Name == "Lock":
					m.importM = true
				case inner != nil && lockParts[inner.Sel.Name] != "":
					if x, ok := inner.X.(*ast.Ident); ok && x.Name == recv {
						m.calls[lockParts[inner.Sel.Name]+"."+sel.Sel.Name] = true
					}
				case inner != nil && inner.Sel.Name == "cfg":
					if x, ok := inner.X.(*ast.Ident); ok && x.Name == recv {
						m.calls[typ+"."+sel.Sel.Name] = true // a func field handed in by Config
					}
				default:
					if x, ok := sel.X.(*ast.Ident); ok && x.Name == recv {
						m.calls[typ+"."+sel.Sel.Name] = true
					}
				}
				return true
			})
			methods[typ+"."+fn.Name.Name] = m
		}
	}
	// The func fields of the parts, as methods calling what Start and the agent's methods wire
	// into them.
	for _, src := range agentSource(t, fset, ".") {
		for _, d := range src.f.Decls {
			fn, ok := d.(*ast.FuncDecl)
			if !ok || fn.Body == nil {
				continue
			}
			recv := "a" // Start's agent
			if fn.Recv == nil && fn.Name.Name != "Start" {
				continue
			}
			if fn.Recv != nil {
				if len(fn.Recv.List) != 1 || len(fn.Recv.List[0].Names) != 1 {
					continue
				}
				if star, ok := fn.Recv.List[0].Type.(*ast.StarExpr); !ok || star.X.(*ast.Ident).Name != "Agent" {
					continue
				}
				recv = fn.Recv.List[0].Names[0].Name
			}
			ast.Inspect(fn.Body, func(n ast.Node) bool {
				lit, ok := n.(*ast.CompositeLit)
				if !ok {
					return true
				}
				var typ string
				switch lt := lit.Type.(type) {
				case *ast.Ident:
					typ = lt.Name
				case *ast.SelectorExpr: // a part of another package (release.Releaser), or its Config
					if pkg, ok := lt.X.(*ast.Ident); ok && lt.Sel.Name == "Config" {
						typ = partPkgs[pkg.Name]
					} else {
						typ = lt.Sel.Name
					}
				}
				if typ == "" || typ == "Agent" || !types[typ] {
					return true
				}
				for _, e := range lit.Elts {
					kv, ok := e.(*ast.KeyValueExpr)
					if !ok {
						continue
					}
					key, ok := kv.Key.(*ast.Ident)
					if !ok {
						continue
					}
					m := &method{pos: fset.Position(kv.Pos()), calls: map[string]bool{}}
					ast.Inspect(kv.Value, func(n ast.Node) bool {
						if _, ok := n.(*ast.GoStmt); ok {
							return false
						}
						sel, ok := n.(*ast.SelectorExpr)
						if !ok {
							return true
						}
						switch inner, _ := sel.X.(*ast.SelectorExpr); {
						case inner != nil && strings.EqualFold(inner.Sel.Name, "locks") && sel.Sel.Name == "Lock":
							m.owner = true
						case inner != nil && inner.Sel.Name == "importMu" && sel.Sel.Name == "Lock":
							m.importM = true
						case inner != nil && lockParts[inner.Sel.Name] != "":
							if x, ok := inner.X.(*ast.Ident); ok && x.Name == recv {
								m.calls[lockParts[inner.Sel.Name]+"."+sel.Sel.Name] = true
							}
						default:
							if x, ok := sel.X.(*ast.Ident); ok && x.Name == recv {
								m.calls["Agent."+sel.Sel.Name] = true
							}
						}
						return true
					})
					name := typ + "." + key.Name
					if old, ok := methods[name]; ok {
						for c := range m.calls {
							old.calls[c] = true
						}
						old.owner, old.importM = old.owner || m.owner, old.importM || m.importM
					} else {
						methods[name] = m
					}
				}
				return true
			})
		}
	}
	// takes reports whether name, or a method it calls, takes an owner lock or importMu.
	memo := map[string]bool{}
	var takes func(name string, seen map[string]bool) bool
	takes = func(name string, seen map[string]bool) bool {
		if v, ok := memo[name]; ok {
			return v
		}
		m, ok := methods[name]
		if _, field, _ := strings.Cut(name, "."); !ok {
			m, ok = methods["Agent."+field] // a func field of a part
		}
		if !ok || seen[name] {
			return false
		}
		seen[name] = true
		v := m.owner || m.importM
		for c := range m.calls {
			v = v || takes(c, seen)
		}
		memo[name] = v
		return v
	}
	names := make([]string, 0, len(methods))
	for name := range methods {
		names = append(names, name)
	}
	sort.Strings(names)
	checked := 0
	for _, name := range names {
		m := methods[name]
		if !m.holds {
			continue
		}
		checked++
		if m.importM {
			t.Errorf("%s: %s holds an owner lock and takes importMu; take importMu first, in a caller", m.pos, name)
		}
		for c := range m.calls {
			if takes(c, map[string]bool{}) {
				t.Errorf("%s: %s holds an owner lock and calls %s, which takes an owner lock or importMu", m.pos, name, c)
			}
		}
	}
	for dir, typ := range partPkgs {
		found := false
		for name := range methods {
			found = found || strings.HasPrefix(name, typ+".")
		}
		if !found {
			t.Errorf("found no method of %s in leases/%s: update partPkgs", typ, dir)
		}
	}
	if checked < 10 {
		t.Errorf("only %d methods of Agent and its parts hold an owner lock: the test no longer finds them", checked)
	}
}
