"""python -m analysis.figures --results=results --output=figures"""

from absl import app

from analysis import figures

if __name__ == '__main__':
  figures.define_flags()
  app.run(figures.main)
