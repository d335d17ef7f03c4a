"""What gets checked and on which parameters: the axes each check depends on, instances generated
from a backend's claims, the coverage record, and the hypothesis strategies and profiles.
"""
