package main

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"runtime/trace"
)

// startProfiles starts the profiles asked for with -cpuprofile, -memprofile, -mutexprofile
// and -blockprofile; they cover the in-process agents of the figures that run. The returned
// function writes them.
func startProfiles(cpu, mem, mutex, block string) (func() error, error) {
	var stops []func() error
	if cpu != "" {
		f, err := os.Create(cpu)
		if err != nil {
			return nil, err
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			f.Close()
			return nil, err
		}
		stops = append(stops, func() error { pprof.StopCPUProfile(); return f.Close() })
	}
	write := func(name, path string) func() error {
		return func() error {
			f, err := os.Create(path)
			if err != nil {
				return err
			}
			if err := pprof.Lookup(name).WriteTo(f, 0); err != nil {
				f.Close()
				return fmt.Errorf("%s profile: %w", name, err)
			}
			return f.Close()
		}
	}
	if mem != "" {
		// Every allocation sampled, not one per 512 KiB: the profile is read as allocations
		// per operation.
		runtime.MemProfileRate = 1
		stops = append(stops, write("allocs", mem))
	}
	if mutex != "" {
		runtime.SetMutexProfileFraction(1)
		stops = append(stops, write("mutex", mutex))
	}
	if block != "" {
		runtime.SetBlockProfileRate(1000) // one event per microsecond blocked
		stops = append(stops, write("block", block))
	}
	return func() error {
		for _, s := range stops {
			if err := s(); err != nil {
				return err
			}
		}
		return nil
	}, nil
}

// phaseProfile starts a CPU profile and an execution trace named name in dir (nothing
// when dir is empty) and returns the function that stops them. A CPU profile already
// running for the whole run (-cpuprofile) leaves only the trace.
func phaseProfile(dir, name string) func() {
	if dir == "" {
		return func() {}
	}
	var stops []func()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		progress("phase profile: %v", err)
		return func() {}
	}
	if f, err := os.Create(filepath.Join(dir, name+".cpu")); err == nil {
		if pprof.StartCPUProfile(f) == nil {
			stops = append(stops, func() { pprof.StopCPUProfile(); f.Close() })
		} else {
			f.Close()
		}
	}
	if f, err := os.Create(filepath.Join(dir, name+".trace")); err == nil {
		if trace.Start(f) == nil {
			stops = append(stops, func() { trace.Stop(); f.Close() })
		} else {
			f.Close()
		}
	}
	return func() {
		for _, s := range stops {
			s()
		}
		progress("phase profile %s written to %s", name, dir)
	}
}
