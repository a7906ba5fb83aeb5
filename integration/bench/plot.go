package main

import (
	"image/color"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
)

// plotSweep draws ADD p50 against allocated addresses for both plugins.
func plotSweep(res *results, path string) error {
	p := plot.New()
	p.Title.Text = "CNI ADD p50 latency vs pool occupancy (/16, sequential, real binaries)"
	p.X.Label.Text = "allocated addresses in the pool"
	p.Y.Label.Text = "ADD p50 latency (ms)"
	p.Legend.Top = true
	p.Legend.Left = false
	p.Legend.XOffs = -vg.Points(10)
	p.Legend.YOffs = -vg.Points(10)
	p.Add(plotter.NewGrid())
	series := []struct {
		plugin string
		label  string
		color  color.Color
		shape  draw.GlyphDrawer
	}{
		{"leasehold", "leasehold (plugin + leaseholdd + etcd, fsync)", color.RGBA{R: 0x1f, G: 0x77, B: 0xb4, A: 0xff}, draw.CircleGlyph{}},
		{"host-local", "host-local (files in dataDir)", color.RGBA{R: 0xd6, G: 0x27, B: 0x28, A: 0xff}, draw.SquareGlyph{}},
		{"leasehold-ref", "leasehold into an empty pool, interleaved (machine load reference)", color.RGBA{R: 0x7f, G: 0x7f, B: 0x7f, A: 0xff}, draw.TriangleGlyph{}},
	}
	for _, s := range series {
		var pts plotter.XYs
		for _, pt := range res.sweep {
			if pt.Plugin == s.plugin {
				pts = append(pts, plotter.XY{X: float64(pt.Allocated), Y: ms(pt.P50)})
			}
		}
		if len(pts) == 0 {
			continue
		}
		line, points, err := plotter.NewLinePoints(pts)
		if err != nil {
			return err
		}
		line.Color = s.color
		line.Width = vg.Points(1.5)
		if s.plugin == "leasehold-ref" {
			line.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
			line.Width = vg.Points(1)
		}
		points.Color = s.color
		points.Shape = s.shape
		points.Radius = vg.Points(3)
		p.Add(line, points)
		p.Legend.Add(s.label, line, points)
	}
	p.Y.Min = 0
	p.X.Min = 0
	return p.Save(9*vg.Inch, 5.5*vg.Inch, path)
}
